"""Experiment: a persistent batch-1 GEMV whose programs stream several row blocks in one loop.

The engine's GEMV gives each program BLOCK_N rows: a 94 MB gate_up of the Qwen3.5-4B-shaped
hybrid is 2,304 programs in ~2.2 waves, each with its own pipeline fill and drain, and the
last wave only partly full. Here the grid is a few programs per multiprocessor, and each walks
its row blocks (pid, pid + P, ...) in one flattened loop over (block, column step), so its
loads stay in flight from one block to the next; a block's sum is stored when its last
column step is in. The question: how much of the gap between the GEMV (3.3-3.7 TB/s on these
shapes) and the copy ceiling (~4.2) is fills, drains and the partial last wave.

Timed as the engine runs them: a CUDA graph of one product through `--layers` distinct
weights of each shape (weights stream from memory), against the engine's GEMV at each of its
start-up candidate launch shapes and cuBLAS.

Usage: python benchmarks/gemv_persistent_proto.py [--check] [--out F]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from atom_kernels import pdl
from atom_kernels.pdl import wait_for_inputs


@triton.jit
def _persistent_gemv_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    N,
    w_stride,
    num_blocks,
    K_STEPS,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_inputs(PDL)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    mine = tl.cdiv(num_blocks - pid, programs)
    lane = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for it in range(0, mine * K_STEPS):
        block = pid + (it // K_STEPS) * programs
        k0 = (it % K_STEPS) * BLOCK_K
        rows = block * BLOCK_N + lane
        row_mask = rows < N
        w = tl.load(
            w_ptr + rows.to(tl.int64)[:, None] * w_stride + (k0 + offs_k)[None, :],
            mask=row_mask[:, None],
            other=0.0,
        )
        x = tl.load(x_ptr + k0 + offs_k).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
        if it % K_STEPS == K_STEPS - 1:
            y = tl.sum(acc, axis=1)
            tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_mask)
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)


def persistent_gemv(x, w, *, block_n, block_k, per_sm, warps, stages):
    """y = x @ w.T for one row x ([1, K]); K a multiple of block_k."""
    n, k = w.shape
    assert k % block_k == 0 and w.stride(1) == 1
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    blocks = triton.cdiv(n, block_n)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 3
    grid = (min(blocks, per_sm * sms),)
    _persistent_gemv_kernel[grid](
        x, w, out, n, w.stride(0), blocks, k // block_k, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages, **pdl.options(x.device),
    )  # fmt: skip
    return out


SHAPES = {
    "hybrid in_proj": (12352, 2560),
    "hybrid gate_up": (18432, 2560),
    "hybrid down": (2560, 9216),
    "hybrid out_proj": (2560, 4096),
    "hybrid attn qkv": (10240, 2560),
    "8B qkv": (6144, 4096),
    "8B o": (4096, 4096),
    "8B gate_up": (28672, 4096),
    "8B down": (4096, 14336),
}


def check(device: str) -> None:
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    for n, k in ((300, 512), (64, 1024)):
        w = torch.randn(n, k, device=device, dtype=dtype)
        x = torch.randn(1, k, device=device, dtype=dtype)
        want = F.linear(x.float(), w.float())
        for block_n, per_sm in ((8, 1), (16, 4)):
            got = persistent_gemv(
                x, w, block_n=block_n, block_k=128, per_sm=per_sm, warps=4, stages=3
            )
            err = (got.float() - want).abs().max().item()
            print(f"check {n}x{k} bn{block_n} per_sm{per_sm}: max err {err:.3f}")
            assert err < (0.5 if dtype == torch.bfloat16 else 1e-3), err


def bench(layers: int, only: list[str] | None) -> dict:
    from atom_kernels.gemv import gemv, launch_candidates
    from atom_runtime.worker.kernel_choice import graph_times

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid = list(itertools.product((8, 16), (128,), (2, 4, 8), (4, 8), (4,)))
    grid += [(8, 256, 4, 8, 4), (8, 128, 4, 8, 6), (16, 128, 4, 8, 3)]
    report = {}
    for name, (n, k) in SHAPES.items():
        if only and name not in only:
            continue
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        mb = n * k * 2 / 1e6
        fns, labels = [lambda ws=ws, x=x: [F.linear(x, w) for w in ws]], ["cuBLAS"]
        for c in launch_candidates(n, k, sms):
            fns.append(lambda ws=ws, x=x, c=c: [gemv(x, w, **c) for w in ws])
            labels.append(f"engine bn{c['block_n']} bk{c['block_k']} s{c['split']} "
                          f"w{c['num_warps']} st{c['num_stages']}")  # fmt: skip
        for bn, bk, per_sm, warps, stages in grid:
            if k % bk:
                continue
            fns.append(
                lambda ws=ws, x=x, cfg=(bn, bk, per_sm, warps, stages): [
                    persistent_gemv(x, w, block_n=cfg[0], block_k=cfg[1], per_sm=cfg[2],
                                    warps=cfg[3], stages=cfg[4])
                    for w in ws
                ]
            )  # fmt: skip
            labels.append(f"persistent bn{bn} bk{bk} per_sm{per_sm} w{warps} st{stages}")
        times = graph_times(*fns)
        rows = sorted(
            ((lab, round(t / layers * 1e3, 2), round(mb / (t / layers * 1e3), 2))
             for lab, t in zip(labels, times, strict=True)),
            key=lambda r: r[1],
        )  # fmt: skip
        best_engine = min((r for r in rows if r[0].startswith("engine")), key=lambda r: r[1])
        best_persistent = min(
            (r for r in rows if r[0].startswith("persistent")), key=lambda r: r[1]
        )
        cublas = next(r for r in rows if r[0] == "cuBLAS")
        report[name] = {"n": n, "k": k, "cublas": cublas, "engine": best_engine,
                        "persistent": best_persistent, "top": rows[:5]}  # fmt: skip
        print(f"{name:16s} {n}x{k}: cuBLAS {cublas[1]} us ({cublas[2]} TB/s), engine "
              f"{best_engine[1]} ({best_engine[2]}; {best_engine[0][7:]}), persistent "
              f"{best_persistent[1]} ({best_persistent[2]}; {best_persistent[0][11:]})",
              flush=True)  # fmt: skip
        del ws
        torch.cuda.empty_cache()
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--shapes", help="comma-separated names of SHAPES (default: all)")
    parser.add_argument("--out", default="gemv_persistent.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        check("cpu")  # under TRITON_INTERPRET=1
        return 0
    check("cuda")
    if args.check:
        return 0
    report = bench(args.layers, args.shapes.split(",") if args.shapes else None)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

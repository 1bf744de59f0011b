"""The absorbed MLA decode kernel (`atom_kernels.mla_attention.mla_decode_attention`) on one GPU,
against the bytes it must read: DeepSeek-V3's shapes, bf16 (benchmarks/configs/deepseek-v3-8l):
128 heads a rank (TP 1; --heads 16 for TP 8), latent 512 + rope 64, pages of 16.

    python benchmarks/mla_decode_bench.py --out mla_decode.json               # default launch
    python benchmarks/mla_decode_bench.py --sweep --out mla_decode_sweep.json  # + launch knobs

For each (batch, context) it times the kernel alone (split-K merge included) in a CUDA graph over
several layers' caches (so the latents do not stay in L2 between replays) and prints
microseconds a layer and the effective bandwidth: the latent rows read once (context x 576 x 2
bytes a sequence) over the time. The ideal is the device's copy bandwidth (~4.3 TB/s on an
H200); every head block of a program re-reads the rows, which L2 should mostly absorb. With
--sweep it also times block_h 16/32/64, block_n 16/32/64, num_warps 4/8 and num_stages 1/2/3 and
prints the best per shape, to tune `mla_decode_config`. A check against the torch reference on
one small shape is printed first.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import sys

import torch

LATENT, ROPE, PAGE = 512, 64, 16
L2_BYTES = 60 * 2**20


def _case(batch: int, context: int, heads: int, layers: int):
    blocks = -(-context // PAGE)
    caches = [
        torch.randn(batch * blocks, PAGE, LATENT + ROPE, device="cuda", dtype=torch.bfloat16)
        for _ in range(layers)
    ]
    tables = torch.arange(batch * blocks, device="cuda", dtype=torch.int32).view(batch, blocks)
    tables = tables[:, torch.randperm(blocks, device="cuda")].contiguous()
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    q_latent = torch.randn(heads, batch, LATENT, device="cuda", dtype=torch.bfloat16)
    q_rope = torch.randn(batch, heads, ROPE, device="cuda", dtype=torch.bfloat16)
    return caches, tables, lens, q_latent.transpose(0, 1), q_rope


def _us_per_layer(run, layers: int, replays: int = 20) -> float:
    for i in range(layers):
        run(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(layers):
            run(i)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / layers)
    return sorted(times)[len(times) // 2]


def _check() -> float:
    from atom_kernels import mla_attention, reference

    caches, tables, lens, q_latent, q_rope = _case(3, 300, 16, 1)
    args = (q_latent, q_rope, caches[0], tables, lens, 0.07)
    want = reference.mla_decode_attention(*args)
    return (mla_attention.mla_decode_attention(*args) - want).abs().max().item()


def _measure(batch: int, context: int, heads: int, knobs: dict) -> dict:
    from atom_kernels.mla_attention import mla_decode_attention

    row_bytes = context * (LATENT + ROPE) * 2
    layers = max(2, min(16, -(-4 * L2_BYTES // (batch * row_bytes))))
    caches, tables, lens, q_latent, q_rope = _case(batch, context, heads, layers)
    out = torch.empty(batch, heads, LATENT, device="cuda", dtype=torch.bfloat16)

    def run(i: int):
        mla_decode_attention(q_latent, q_rope, caches[i], tables, lens, 0.07, out, **knobs)

    us = _us_per_layer(run, layers)
    return {"us_per_layer": us, "tb_per_s": batch * row_bytes / us / 1e6}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--contexts", default="1024,4096,16384")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA/ROCm GPU", file=sys.stderr)
        return 1
    print(f"check vs reference: max |diff| {_check():.3e}")
    rows = []
    knob_sets = [{}]
    if args.sweep:
        knob_sets += [
            dict(block_h=h, block_n=n, num_warps=w, num_stages=s)
            for h, n, w, s in itertools.product((16, 32, 64), (16, 32, 64), (4, 8), (1, 2, 3))
        ]
    for batch in map(int, args.batches.split(",")):
        for context in map(int, args.contexts.split(",")):
            results = []
            for knobs in knob_sets:
                try:
                    results.append({"knobs": knobs, **_measure(batch, context, args.heads, knobs)})
                except Exception as e:  # a launch that does not fit (registers, shared memory)
                    results.append({"knobs": knobs, "error": f"{type(e).__name__}: {e}"[:200]})
            default = results[0]
            best = min((r for r in results if "us_per_layer" in r), key=lambda r: r["us_per_layer"])
            print(
                f"batch {batch:4d} context {context:6d}: default {default.get('us_per_layer', 0):8.1f}"
                f" us {default.get('tb_per_s', 0):5.2f} TB/s; best {best['us_per_layer']:8.1f} us"
                f" {best['tb_per_s']:5.2f} TB/s {best['knobs']}"
            )
            rows.append({"batch": batch, "context": context, "results": results})
    if args.out:
        meta = {
            "device": torch.cuda.get_device_name(),
            "host": platform.node(),
            "heads": args.heads,
        }
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

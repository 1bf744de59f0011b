"""Batch-1 GEMV launch shapes against cuBLAS with weights streaming from memory, as in a decode
step: each timed graph runs one product through `--layers` distinct weights of the shape.

python benchmarks/gemv_sweep.py --model benchmarks/configs/llama-3.1-8b [--out sweep.json]
python benchmarks/gemv_sweep.py --model benchmarks/configs/llama-3.1-8b --paired

`--paired` sweeps the epilogues that pair two weight rows per output instead: gate_up with
SwiGLU and qkv with rotary + the K/V cache store (with QK-norm too for a QK-norm model, whose
programs own whole heads), against the plain GEMV's default shape and cuBLAS, and, for the qkv
epilogues, against cuBLAS followed by the QK-prep kernel they replace.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from atom_kernels import ops
from atom_kernels.gemv import RopeStore, gemv, gemv_config
from atom_runtime.worker.kernel_choice import graph_times


def shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * inter, h), "down": (h, inter)}


def paired_sweep(cfg: dict, layers: int, only: str | None = None) -> dict:
    """gate_up with SwiGLU and qkv with rotary + cache store over a grid of launch shapes."""
    (n_qkv, h), (n_gu, _) = shapes(cfg)["qkv"], shapes(cfg)["gate_up"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    cache = torch.zeros(64, 16, kv_heads, hd, device="cuda", dtype=torch.bfloat16)
    angles = torch.rand(4096, hd // 2, device="cuda")
    rope = RopeStore(
        torch.tensor([100], device="cuda"),
        torch.cat([angles.cos(), angles.sin()], dim=-1),
        cache,
        cache.clone(),
        torch.tensor([37], device="cuda"),
        heads,
        kv_heads,
        hd,
    )
    mp = torch.cuda.get_device_properties(0).multi_processor_count
    grid = list(itertools.product((4, 8, 16), (128, 256), (1, 2, 4, 8), (4, 8)))
    cases = [("qkv+rope", n_qkv, {"rope": rope}, grid)]
    if cfg.get("model_type") == "qwen3":
        ones = torch.ones(hd, device="cuda", dtype=torch.bfloat16)
        normed = rope._replace(q_norm_weight=ones, k_norm_weight=ones)
        head_grid = list(itertools.product((hd,), (32, 64, 128, 256), (1, 2, 4, 8, 16), (4, 8)))
        cases.append(("qkv+qknorm+rope", n_qkv, {"rope": normed}, head_grid))
    cases.append(("gate_up+silu", n_gu, {"act": "silu_mul"}, grid))
    report = {}
    for name, n, extra, shapes_grid in cases:
        if only is not None and name != only:
            continue
        ws = [torch.randn(n, h, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
        x = torch.randn(1, h, device="cuda", dtype=torch.bfloat16)
        mb = n * h * 2 / 1e6

        def per_weight(fn, ws=ws):
            return graph_times(lambda: [fn(w) for w in ws])[0] / layers * 1e3

        base = {
            "cublas": per_weight(lambda w, x=x: F.linear(x, w)),
            "gemv plain": per_weight(lambda w, x=x: gemv(x, w)),
            "paired, default shape": per_weight(lambda w, x=x, e=extra: gemv(x, w, **e)),
        }
        if "rope" in extra:  # what the epilogue replaces: cuBLAS, then the QK-prep kernel
            r = extra["rope"]

            def unfused(w, x=x, r=r):
                y = F.linear(x, w)
                ops.qk_norm_rope_store_(
                    y, r.positions, r.cos_sin_cache, r.q_norm_weight, r.k_norm_weight, 1e-6,
                    r.k_cache, r.v_cache, r.slot_mapping, heads, kv_heads, hd,
                )  # fmt: skip

            base["cublas + qk-prep"] = per_weight(unfused)
        rows = []
        for bn, bk, sp, nw in shapes_grid:

            def fn(w, bn=bn, bk=bk, sp=sp, nw=nw, x=x, e=extra):
                return gemv(x, w, block_n=bn, block_k=bk, split=sp, num_warps=nw, **e)

            t = per_weight(fn)
            rows.append((f"bn{bn} bk{bk} s{sp} w{nw}", round(t, 2), round(mb / t, 2)))
        rows.sort(key=lambda r: r[1])
        report[name] = {
            "n": n,
            "k": h,
            "default": gemv_config(n, h, mp),
            **{k: round(v, 2) for k, v in base.items()},
            "best": rows[:8],
        }
        print(name, report[name], flush=True)
    return report


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--out")
    ap.add_argument("--paired", action="store_true", help="sweep the SwiGLU and rotary epilogues")
    ap.add_argument("--case", help="with --paired: only this one (qkv+rope, qkv+qknorm+rope, ...)")
    ap.add_argument(
        "--shapes",
        help="NxK,NxK,...: these weight shapes instead of the model's (a hybrid's in_proj, ...)",
    )
    ap.add_argument(
        "--small-grid", action="store_true", help="48 launch shapes instead of 108 (a quick look)"
    )
    args = ap.parse_args()
    cfg = json.load(open(f"{args.model}/config.json"))
    cfg = cfg.get("text_config", cfg)
    if args.paired:
        report = paired_sweep(cfg, args.layers, args.case)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=2)
        return
    if args.small_grid:
        grid = list(itertools.product((8, 16, 32), (128, 256), (1, 2), (4, 8), (3, 4)))
    else:
        grid = list(itertools.product((8, 16, 32), (128, 256, 512), (1, 2, 4), (4, 8), (2, 4)))
    if args.shapes:
        named = {s: tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",")}
    else:
        named = shapes(cfg)
    report = {}
    for name, (n, k) in named.items():
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(args.layers)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        mb = n * k * 2 / 1e6
        base = graph_times(lambda: [F.linear(x, w) for w in ws])[0] / args.layers * 1e3  # noqa: B023
        default = graph_times(lambda: [gemv(x, w) for w in ws])[0] / args.layers * 1e3  # noqa: B023
        rows = []
        for bn, bk, sp, nw, ns in grid:

            def fn(bn=bn, bk=bk, sp=sp, nw=nw, ns=ns, ws=ws, x=x):
                return [
                    gemv(x, w, block_n=bn, block_k=bk, split=sp, num_warps=nw, num_stages=ns)
                    for w in ws
                ]

            t = graph_times(fn)[0] / args.layers * 1e3
            rows.append((f"bn{bn} bk{bk} s{sp} w{nw} st{ns}", round(t, 2), round(mb / t, 2)))
        rows.sort(key=lambda r: r[1])
        report[name] = {
            "n": n,
            "k": k,
            "default": gemv_config(n, k, torch.cuda.get_device_properties(0).multi_processor_count),
            "cublas_us": round(base, 2),
            "cublas_TBps": round(mb / base, 2),
            "default_us": round(default, 2),
            "best": rows[:6],
        }
        print(name, report[name], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()

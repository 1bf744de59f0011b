"""Batch-1 GEMV launch shapes against cuBLAS with weights streaming from memory, as in a decode
step: each timed graph runs one product through `--layers` distinct weights of the shape.

python benchmarks/gemv_sweep.py --model benchmarks/configs/llama-3.1-8b [--out sweep.json]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from atom_kernels.gemv import gemv
from atom_runtime.layers.linear import graph_time


def shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * inter, h), "down": (h, inter)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--out")
    args = ap.parse_args()
    cfg = json.load(open(f"{args.model}/config.json"))
    grid = list(itertools.product((8, 16, 32), (128, 256, 512), (1, 2, 4), (4, 8), (2, 4)))
    report = {}
    for name, (n, k) in shapes(cfg).items():
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(args.layers)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        mb = n * k * 2 / 1e6
        base = graph_time(lambda: [F.linear(x, w) for w in ws]) / args.layers * 1e3  # noqa: B023
        rows = []
        for bn, bk, sp, nw, ns in grid:

            def fn(bn=bn, bk=bk, sp=sp, nw=nw, ns=ns, ws=ws, x=x):
                return [
                    gemv(x, w, block_n=bn, block_k=bk, split=sp, num_warps=nw, num_stages=ns)
                    for w in ws
                ]

            t = graph_time(fn) / args.layers * 1e3
            rows.append((f"bn{bn} bk{bk} s{sp} w{nw} st{ns}", round(t, 2), round(mb / t, 2)))
        rows.sort(key=lambda r: r[1])
        report[name] = {
            "n": n,
            "k": k,
            "cublas_us": round(base, 2),
            "cublas_TBps": round(mb / base, 2),
            "best": rows[:6],
        }
        print(name, report[name], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()

"""Prefill attention on one 8,192-token prompt by KV page size: is the paged gather what keeps
the kernel from SDPA's throughput? The engine's pages hold 16 tokens, so a 64-key tile gathers
row by row ("row" lookup); with 64- or 256-token pages a tile lies in one page ("tile" lookup,
one table read a tile, rows contiguous).

python benchmarks/prefill_page_sweep.py [--out prefill_pages.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from kernels_bench import PrefillProblem

HEADS = {"qwen3-0.6b": (16, 8, 128), "llama-3.1-8b": (32, 8, 128)}
CONFIGS = [
    ("128x64w4s3", dict(block_m=128, block_n=64, num_warps=4, num_stages=3)),
    ("128x64w8s3", dict(block_m=128, block_n=64, num_warps=8, num_stages=3)),
    ("128x128w8s3", dict(block_m=128, block_n=128, num_warps=8, num_stages=3)),
    ("128x128w8s2", dict(block_m=128, block_n=128, num_warps=8, num_stages=2)),
    ("128x64w4s4", dict(block_m=128, block_n=64, num_warps=4, num_stages=4)),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--pages", default="16,64,256")
    args = ap.parse_args()
    rows = []
    for model, heads in HEADS.items():
        sdpa = None
        for page in map(int, args.pages.split(",")):
            problem = PrefillProblem(heads, [(0, 8192)], block_size=page)
            if sdpa is None:
                sdpa = problem.sdpa_ms()
                tflops = problem.flops / (sdpa * 1e-3) / 1e12
                rows.append(dict(model=model, config="sdpa-dense", TFLOP_per_s=round(tflops, 1)))
                print(f"{model} sdpa dense: {sdpa:.3f} ms, {tflops:.0f} TFLOP/s", flush=True)
            for name, launch in CONFIGS:
                try:
                    ms = problem.time_ms(**launch)
                except Exception as exc:  # a tiling this GPU cannot build
                    print(f"{model} page {page} {name}: {type(exc).__name__}", file=sys.stderr)
                    continue
                tflops = problem.flops / (ms * 1e-3) / 1e12
                row = dict(model=model, page=page, config=name, plan=problem.plan(**launch),
                           ms=round(ms, 4), TFLOP_per_s=round(tflops, 1),
                           of_sdpa=round(sdpa / ms, 3), max_err=round(problem.max_error(), 4))  # fmt: skip
                rows.append(row)
                print(f"{model} page {page:3d} {name:12s} {ms:.3f} ms {tflops:5.0f} TFLOP/s "
                      f"({sdpa / ms:.0%} of SDPA) err {row['max_err']}", flush=True)  # fmt: skip
            del problem
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

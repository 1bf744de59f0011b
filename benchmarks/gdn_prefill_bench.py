"""Gated DeltaNet prefill kernels on one GPU: this repository's chunked kernel at chunks of 16, 32
and 64 tokens against fla-core's (when installed), bf16, Qwen3.5-4B heads (16 k / 32 v of 128).

python benchmarks/gdn_prefill_bench.py [--out gdn_prefill.json]

Microseconds a layer (`triton.testing.do_bench`) for three batch shapes: a W5-style mixed step
(15 decode rows and one 500-token chunk), W1-style prefill (8 rows of 1,024) and one long prompt.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from atom_kernels import gdn

SHAPES = [("15 decodes + 500", [1] * 15 + [500]), ("8 x 1024", [1024] * 8), ("one 4096", [4096])]


def make_case(lens: list[int], hk: int = 16, hv: int = 32, d: int = 128) -> tuple:
    t, b, dev = sum(lens), len(lens), "cuda"
    q = torch.randn(t, hk, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn_like(q)
    v = torch.randn(t, hv, d, device=dev, dtype=torch.bfloat16)
    g = -torch.rand(t, hv, device=dev) * 0.1
    beta = torch.rand(t, hv, device=dev, dtype=torch.bfloat16)
    state = torch.zeros(b, hv, d, d, device=dev)
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    slots = torch.arange(b, dtype=torch.int32, device=dev)
    resume = torch.ones(b, dtype=torch.bool, device=dev)
    return q, k, v, g, beta, state, starts.to(dev), slots, resume, d**-0.5


def time_us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=3, rep=20) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the timings (us a layer) to this JSON file")
    args = ap.parse_args()
    rows = []
    for name, lens in SHAPES:
        case = make_case(lens)
        row = {"shape": name}
        for chunk in (16, 32, 64):
            us = time_us(lambda c=chunk, a=case: gdn.gated_delta_rule_chunked_(*a, chunk=c))
            row[f"own{chunk}_us"] = round(us, 1)
        if gdn._fla_chunk() is not None:
            row["fla_us"] = round(time_us(lambda a=case: gdn.gated_delta_rule_chunked_fla_(*a)), 1)
        rows.append(row)
        print(" | ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

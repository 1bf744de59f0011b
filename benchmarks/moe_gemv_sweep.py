"""The one-token MoE step (`moe.fused_moe_gemv`) by launch shape, at the released MoE hybrids'
expert sizes: microseconds a layer and the GB/s of expert weights it streams.

python benchmarks/moe_gemv_sweep.py [--out moe_gemv.json]

Each timed call routes its token to a fresh random set of experts (64 sets, replayed from one
CUDA graph), so the weights come from HBM as in a decode step, not from L2. The router kernel
(`moe.moe_topk`) is timed the same way.
"""

from __future__ import annotations

import argparse
import json

import torch

# name: (routed experts, top k, hidden, moe intermediate); the shared expert is stacked as one
# more expert, so every token has top k + 1 pairs.
SHAPES = {
    "qwen3.5-35b-a3b": (256, 8, 2048, 512),
    "qwen3-next-80b-a3b": (512, 10, 2048, 512),
}
# (BLOCK_N gate/up rows of each kind a program, BLOCK_K, warps); the down launch takes 2 x
# BLOCK_N rows.
CANDIDATES = [(16, 128, 4), (8, 256, 4), (8, 128, 4), (4, 256, 4), (8, 256, 8), (16, 256, 8)]
SETS = 64


def _graph_time_us(fn, sets: int) -> float:
    """Microseconds a call: `fn(i)` for each of `sets` routings captured in one graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(sets):
            fn(i)  # compile, warm
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(sets):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / sets)
    return best


def sweep(name: str) -> list[dict]:
    from atom_kernels import moe

    e, k, h, inter = SHAPES[name]
    torch.manual_seed(0)
    kw = {"dtype": torch.bfloat16, "device": "cuda"}
    x = torch.randn(1, h, **kw)
    w13 = torch.randn(e + 1, 2 * inter, h, **kw) / h**0.5
    w2 = torch.randn(e + 1, h, inter, **kw) / inter**0.5
    logits = [torch.randn(1, e + 1, **kw) for _ in range(SETS)]
    routes = [moe.moe_topk(lg, k, True, True) for lg in logits]
    weight_bytes = (k + 1) * 3 * inter * h * 2
    rows = []
    us = _graph_time_us(lambda i: moe.moe_topk(logits[i], k, True, True), SETS)
    rows.append({"model": name, "kernel": "moe_topk", "us": round(us, 2)})
    for block_n, block_k, warps in CANDIDATES:

        def call(i, bn=block_n, bk=block_k, w=warps):
            weights, ids = routes[i]
            moe.fused_moe_gemv(x, w13, w2, weights, ids, block_n=bn, block_k=bk, num_warps=w)

        us = _graph_time_us(call, SETS)
        rows.append({
            "model": name, "kernel": "fused_moe_gemv", "block_n": block_n, "block_k": block_k,
            "warps": warps, "us": round(us, 2), "GB_per_s": round(weight_bytes / us / 1e3, 1),
        })  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = []
    for name in SHAPES:
        rows += sweep(name)
    for r in rows:
        shape = (
            f" {r['block_n']:>2} x {r['block_k']:>3}, {r['warps']} warps" if "warps" in r else ""
        )
        rate = f"  {r['GB_per_s']:7.1f} GB/s" if "GB_per_s" in r else ""
        print(f"{r['model']:<20} {r['kernel']:<15}{shape:<22} {r['us']:8.2f} us{rate}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()

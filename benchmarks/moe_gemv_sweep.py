"""The one-token MoE step (`moe.fused_moe_gemv`) by launch shape, at the released MoE hybrids'
expert sizes: microseconds a layer for each kernel and the GB/s of expert weights it streams.

python benchmarks/moe_gemv_sweep.py [--tokens 1,2,4,8] [--out moe_gemv.json]

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
SETS = 64


def sweep(name: str) -> list[dict]:
    """The router kernel, then every launch-shape candidate of the two pair-GEMV kernels as the
    engine's start-up times them (`moe.tune_gemv_launch`), on 64 random routings."""
    from atom_kernels import moe

    e, k, h, inter = SHAPES[name]
    torch.manual_seed(0)
    kw = {"dtype": torch.bfloat16, "device": "cuda"}
    x = torch.randn(1, h, **kw)
    w13 = torch.randn(e + 1, 2 * inter, h, **kw) / h**0.5
    w2 = torch.randn(e + 1, h, inter, **kw) / inter**0.5
    logits = [torch.randn(1, e + 1, **kw) for _ in range(SETS)]
    rows = []
    us = moe.graph_call_us(lambda i: moe.moe_topk(logits[i], k, True, True), SETS)
    rows.append({"model": name, "kernel": "moe_topk", "us": round(us, 2)})
    table = moe.tune_gemv_launch(x, w13, w2, k + 1, routings=SETS)
    sizes = {"gate_up": 2 * inter * h * 2 * (k + 1), "down": inter * h * 2 * (k + 1)}
    best = dict(zip(("gate_up", "down"), table["best"], strict=True))
    for kernel in ("gate_up", "down"):
        for (block_n, block_k, warps), us in table[kernel].items():
            rows.append({
                "model": name, "kernel": kernel, "block_n": block_n, "block_k": block_k,
                "warps": warps, "us": round(us, 2),
                "GB_per_s": round(sizes[kernel] / us / 1e3, 1),
                "best": (block_n, block_k, warps) == best[kernel],
            })  # fmt: skip
    return rows


def by_tokens(name: str, tokens: list[int]) -> list[dict]:
    """A step of a few tokens through each MoE path (the pair GEMV at its tuned shapes, the
    sorted grouped GEMMs), fresh routings per call: where ATOM_MOE_GEMV_MAX_TOKENS should sit."""
    from atom_kernels import moe

    e, k, h, inter = SHAPES[name]
    torch.manual_seed(1)
    kw = {"dtype": torch.bfloat16, "device": "cuda"}
    w13 = torch.randn(e + 1, 2 * inter, h, **kw) / h**0.5
    w2 = torch.randn(e + 1, h, inter, **kw) / inter**0.5
    rows = []
    saved = moe.MOE_GEMV
    for t in tokens:
        x = torch.randn(t, h, **kw)
        routes = [moe.moe_topk(torch.randn(t, e + 1, **kw), k, True, True) for _ in range(SETS)]
        shapes = moe.launch_shapes(x, w13, w2, k + 1)
        gemv_us = moe.graph_call_us(
            lambda i, x=x, r=routes, s=shapes: moe.fused_moe_gemv(x, w13, w2, *r[i], *s), SETS
        )
        moe.MOE_GEMV = False  # fused_moe takes the sorted path at any size
        try:
            sorted_us = moe.graph_call_us(
                lambda i, x=x, r=routes: moe.fused_moe(x, w13, w2, *r[i]), SETS
            )
        finally:
            moe.MOE_GEMV = saved
        for path, us in (("pair GEMV", gemv_us), ("sorted GEMMs", sorted_us)):
            rows.append({"model": name, "kernel": path, "tokens": t, "us": round(us, 2)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument(
        "--tokens", default="", help="also time both MoE paths at these step sizes, e.g. 1,2,4,8"
    )
    args = ap.parse_args()
    rows = []
    for name in SHAPES:
        rows += sweep(name)
        if args.tokens:
            rows += by_tokens(name, [int(t) for t in args.tokens.split(",")])
    for r in rows:
        shape = (
            f" {r['block_n']:>2} x {r['block_k']:>3}, {r['warps']} warps" if "warps" in r else ""
        )
        shape = f" {r['tokens']} tokens" if "tokens" in r else shape
        rate = f"  {r['GB_per_s']:7.1f} GB/s" if "GB_per_s" in r else ""
        mark = "  <- chosen" if r.get("best") else ""
        print(f"{r['model']:<20} {r['kernel']:<9}{shape:<22} {r['us']:8.2f} us{rate}{mark}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()

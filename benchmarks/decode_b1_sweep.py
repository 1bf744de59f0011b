"""Decode attention at batch 1 (W2's step): the split + merge launch the engine makes against
other split counts and tile shapes, per layer, in a CUDA graph over distinct per-layer caches.

python benchmarks/decode_b1_sweep.py [--out decode_b1.json]

W2 decodes one sequence whose context grows from 128 to 384 tokens; the decode graph is captured
with the block table's full width (max_model_len / page), which is what the automatic split count
sees. Each row times `layers` launches (one per layer, each over its own cache, as in a step),
so the K/V of one layer is not in L2 from the launch before.
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

from atom_kernels import decode_attention

# q heads, kv heads, layers, head_dim (the hybrid's: its 8 gated-attention layers)
SHAPES = {
    "qwen3-0.6b": (16, 8, 28, 128),
    "llama-3.1-8b": (32, 8, 32, 128),
    "qwen3.5-4b": (16, 4, 8, 256),
}


def time_graph(fn, replays: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / replays)
    return best * 1e3  # us


def attend_all(caches, q, table, lens, out, launch) -> None:
    """One decode attention launch per layer's cache, with the launch settings `launch`."""
    for k_cache, v_cache in caches:
        decode_attention.paged_attention_decode(
            q, k_cache, v_cache, table, lens, q.shape[-1] ** -0.5, out, **launch
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--max-model-len", type=int, default=40960)
    ap.add_argument("--engine-only", action="store_true", help="only the engine's own launch")
    ap.add_argument("--models", default=",".join(SHAPES), help="comma-separated SHAPES keys")
    args = ap.parse_args()
    dev, dtype, page = torch.device("cuda"), torch.bfloat16, 16
    width = args.max_model_len // page
    rows = []
    for model in args.models.split(","):
        heads, kv_heads, layers, head_dim = SHAPES[model]
        tiles = (64, 128, 256) if head_dim <= 128 else (32, 64, 128)
        blocks = 400 // page + 1
        caches = [
            (
                torch.randn(blocks, page, kv_heads, head_dim, device=dev, dtype=dtype),
                torch.randn(blocks, page, kv_heads, head_dim, device=dev, dtype=dtype),
            )
            for _ in range(layers)
        ]
        table = torch.zeros(1, width, dtype=torch.int32, device=dev)
        table[0, :blocks] = torch.arange(blocks, device=dev)
        q = torch.randn(1, heads, head_dim, device=dev, dtype=dtype)
        out = torch.empty_like(q)
        for ctx in (128, 256, 384):
            lens = torch.tensor([ctx], dtype=torch.int32, device=dev)
            configs = [("engine", {})]
            for splits in () if args.engine_only else (1, 2, 4, 8):
                for block_n in tiles:
                    for warps in (4, 8):
                        if block_n * splits > 2 * ctx + 64:
                            continue
                        name = f"s{splits}-n{block_n}-w{warps}"
                        configs.append(
                            (name, dict(num_splits=splits, block_n=block_n, num_warps=warps,
                                        num_stages=2 if block_n >= 256 else 3))
                        )  # fmt: skip
            want = None
            for name, kw in configs:
                run = functools.partial(attend_all, caches, q, table, lens, out, kw)
                try:
                    us = time_graph(run) / layers
                except Exception as exc:  # a launch this GPU cannot build
                    print(f"{model} ctx {ctx} {name}: failed ({type(exc).__name__}: {exc})"[:200])
                    continue
                if want is None:
                    want = out.float().clone()
                err = (out.float() - want).abs().max().item()
                rows.append(dict(model=model, ctx=ctx, config=name, us=round(us, 2), err=err))
                print(
                    f"{model:14s} ctx {ctx:4d} {name:14s} {us:6.2f} us/layer (max diff {err:.3g})"
                )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

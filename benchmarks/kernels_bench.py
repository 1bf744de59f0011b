"""Attention kernel benchmark: decode bandwidth and prefill throughput on one GPU.

    python benchmarks/kernels_bench.py --out results.json

Decode: batch 64, every sequence 4096 tokens in a paged bf16 cache (block 16). Figure:
bytes of K and V read per call / time, against the 4.2 TB/s device-to-device copy ceiling
measured on an H200 (docs/ BENCHMARKS.md). Each split-K setting is timed too, so the
automatic choice can be checked against the best fixed one.

Prefill: 8192 query tokens (one 8k prompt, and 8 prompts of 1k), causal, paged cache.
Figure: TFLOP/s counting 4 * head_dim FLOPs per (query, visible key, head) pair, beside
torch's scaled_dot_product_attention (flash) on the same problem laid out densely.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import sys

import torch

COPY_CEILING_BYTES_PER_S = 4.2e12
MODELS = {
    # name: (num_heads, num_kv_heads, head_dim)
    "llama3-8b": (32, 8, 128),
    "qwen3-0.6b": (16, 8, 128),
}


def _time_ms(fn, warmup: int = 10, iters: int = 50) -> float:
    """Median milliseconds per call, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def _paged_cache(seq_lens, num_kv_heads, head_dim, block_size, dtype):
    """A cache with each sequence's blocks scattered at random, as after hours of serving."""
    blocks_per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = sum(blocks_per_seq)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device="cuda")
    v_cache = torch.randn(shape, dtype=dtype, device="cuda")
    order = torch.randperm(num_blocks, device="cuda").to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32, device="cuda")
    at = 0
    for b, nb in enumerate(blocks_per_seq):
        tables[b, :nb] = order[at : at + nb]
        at += nb
    return k_cache, v_cache, tables


def bench_decode(model: str, batch: int, context: int, block_size: int, quick: bool) -> list[dict]:
    from atom_kernels import decode_attention

    num_heads, num_kv_heads, head_dim = MODELS[model]
    dtype = torch.bfloat16
    k_cache, v_cache, tables = _paged_cache(
        [context] * batch, num_kv_heads, head_dim, block_size, dtype
    )
    q = torch.randn(batch, num_heads, head_dim, dtype=dtype, device="cuda")
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    kv_bytes = 2 * batch * context * num_kv_heads * head_dim * k_cache.element_size()
    auto = decode_attention.choose_num_splits(
        batch,
        num_kv_heads,
        tables.shape[1] * block_size,
        decode_attention.decode_config(head_dim)["block_n"],
        torch.cuda.get_device_properties(q.device).multi_processor_count,
    )
    rows = []
    for splits in [None] + ([1, 2, 4, 8] if not quick else []):
        ms = _time_ms(
            lambda s=splits: decode_attention.paged_attention_decode(
                q, k_cache, v_cache, tables, lens, head_dim**-0.5, out, num_splits=s
            )
        )
        bw = kv_bytes / (ms * 1e-3)
        rows.append(
            {
                "op": "decode",
                "model": model,
                "batch": batch,
                "context": context,
                "block_size": block_size,
                "num_splits": f"auto({auto})" if splits is None else splits,
                "ms": round(ms, 4),
                "kv_bytes": kv_bytes,
                "GB_per_s": round(bw / 1e9, 1),
                "fraction_of_ceiling": round(bw / COPY_CEILING_BYTES_PER_S, 3),
            }
        )
    return rows


def bench_prefill(model: str, num_seqs: int, seq_len: int, block_size: int) -> list[dict]:
    from atom_kernels import prefill_attention

    num_heads, num_kv_heads, head_dim = MODELS[model]
    dtype = torch.bfloat16
    k_cache, v_cache, tables = _paged_cache(
        [seq_len] * num_seqs, num_kv_heads, head_dim, block_size, dtype
    )
    total = num_seqs * seq_len
    q = torch.randn(total, num_heads, head_dim, dtype=dtype, device="cuda")
    cu = torch.arange(0, total + 1, seq_len, dtype=torch.int32, device="cuda")
    lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    pairs = num_seqs * seq_len * (seq_len + 1) // 2  # causal (query, key) pairs
    flops = 4 * pairs * num_heads * head_dim
    ms = _time_ms(
        lambda: prefill_attention.paged_attention_prefill(
            q, k_cache, v_cache, cu, lens, tables, head_dim**-0.5, seq_len, out
        )
    )
    # Peer: torch SDPA on dense [num_seqs, heads, seq_len, head_dim] tensors (no paging).
    qd = torch.randn(num_seqs, num_heads, seq_len, head_dim, dtype=dtype, device="cuda")
    kd = torch.randn(num_seqs, num_heads, seq_len, head_dim, dtype=dtype, device="cuda")
    vd = torch.randn_like(kd)
    sdpa_ms = _time_ms(
        lambda: torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=True)
    )
    return [
        {
            "op": "prefill",
            "model": model,
            "num_seqs": num_seqs,
            "seq_len": seq_len,
            "block_size": block_size,
            "ms": round(ms, 4),
            "TFLOP_per_s": round(flops / (ms * 1e-3) / 1e12, 1),
            "sdpa_dense_ms": round(sdpa_ms, 4),
            "sdpa_dense_TFLOP_per_s": round(flops / (sdpa_ms * 1e-3) / 1e12, 1),
        }
    ]


def sweep() -> list[dict]:
    """Launch settings around the defaults, to retune `decode_config`/`prefill_config`."""
    from atom_kernels import decode_attention, prefill_attention

    rows = []
    num_heads, num_kv_heads, head_dim = MODELS["llama3-8b"]
    dtype = torch.bfloat16
    for batch, context, splits_list in ((64, 4096, [1]), (4, 32768, [1, 4, 8, 16, 32, None])):
        k_cache, v_cache, tables = _paged_cache(
            [context] * batch, num_kv_heads, head_dim, 16, dtype
        )
        q = torch.randn(batch, num_heads, head_dim, dtype=dtype, device="cuda")
        lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        kv_bytes = 2 * batch * context * num_kv_heads * head_dim * 2
        configs = [
            (64, 4, 2),
            (32, 4, 2),
            (64, 4, 3),
            (128, 4, 2),
            (64, 8, 2),
            (128, 8, 3),
            (32, 2, 3),
        ]
        for splits in splits_list:
            for block_n, warps, stages in configs if batch == 64 else configs[:1]:
                ms = _time_ms(
                    functools.partial(
                        decode_attention.paged_attention_decode,
                        q, k_cache, v_cache, tables, lens, 0.1, num_splits=splits,
                        block_n=block_n, num_warps=warps, num_stages=stages,
                    )
                )  # fmt: skip
                rows.append(
                    {"op": "decode", "batch": batch, "context": context, "splits": str(splits),
                     "block_n": block_n, "warps": warps, "stages": stages, "ms": round(ms, 4),
                     "GB_per_s": round(kv_bytes / (ms * 1e-3) / 1e9, 1)}
                )  # fmt: skip
    seq_len = 8192
    k_cache, v_cache, tables = _paged_cache([seq_len], num_kv_heads, head_dim, 16, dtype)
    q = torch.randn(seq_len, num_heads, head_dim, dtype=dtype, device="cuda")
    cu = torch.tensor([0, seq_len], dtype=torch.int32, device="cuda")
    lens = torch.tensor([seq_len], dtype=torch.int32, device="cuda")
    flops = 4 * seq_len * (seq_len + 1) // 2 * num_heads * head_dim
    for bm, bn, warps, stages in [
        (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2),
        (128, 32, 4, 3), (64, 128, 4, 2), (128, 64, 8, 4), (64, 32, 4, 4), (128, 128, 4, 2),
    ]:  # fmt: skip
        try:
            ms = _time_ms(
                functools.partial(
                    prefill_attention.paged_attention_prefill,
                    q, k_cache, v_cache, cu, lens, tables, 0.1, seq_len, block_m=bm,
                    block_n=bn, num_warps=warps, num_stages=stages,
                )
            )  # fmt: skip
        except Exception as e:  # e.g. out of shared memory for this tiling
            print(f"prefill {bm}x{bn} w{warps} s{stages}: {type(e).__name__}", file=sys.stderr)
            continue
        rows.append(
            {"op": "prefill", "block_m": bm, "block_n": bn, "warps": warps, "stages": stages,
             "ms": round(ms, 4), "TFLOP_per_s": round(flops / (ms * 1e-3) / 1e12, 1)}
        )  # fmt: skip
    return rows


def _print_table(rows: list[dict]) -> None:
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row if k not in keys]
    widths = {k: max(len(k), *(len(str(r.get(k, ""))) for r in rows)) for k in keys}
    print("  ".join(k.ljust(widths[k]) for k in keys))
    for row in rows:
        print("  ".join(str(row.get(k, "")).ljust(widths[k]) for k in keys))
    print()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="kernels_bench.json", help="JSON results file")
    parser.add_argument("--quick", action="store_true", help="small shapes, a smoke test")
    parser.add_argument("--sweep", action="store_true", help="also sweep launch settings")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernels_bench needs a CUDA or ROCm GPU; none is present", file=sys.stderr)
        return 2
    sweep_rows = sweep() if args.sweep else []
    if sweep_rows:
        _print_table([r for r in sweep_rows if r["op"] == "decode"])
        _print_table([r for r in sweep_rows if r["op"] == "prefill"])

    batch, context, prefill_len = (4, 512, 1024) if args.quick else (64, 4096, 8192)
    decode_rows, prefill_rows = [], []
    for model in MODELS:
        for block_size in (16, 128):
            decode_rows += bench_decode(model, batch, context, block_size, args.quick)
        prefill_rows += bench_prefill(model, 1, prefill_len, 16)
        prefill_rows += bench_prefill(model, 8, prefill_len // 8, 16)
    _print_table(decode_rows)
    _print_table(prefill_rows)

    import triton

    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "hip": torch.version.hip,
        "python": platform.python_version(),
        "copy_ceiling_GB_per_s": COPY_CEILING_BYTES_PER_S / 1e9,
        "decode": decode_rows,
        "prefill": prefill_rows,
        "sweep": sweep_rows,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

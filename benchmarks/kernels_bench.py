"""Attention kernel benchmark: decode bandwidth and prefill throughput on one GPU.

    python benchmarks/kernels_bench.py --out results.json

Decode: batch 64, every sequence 4096 tokens in a paged bf16 cache (block 16). Figure:
bytes of K and V read per call / time, against the 4.2 TB/s device-to-device copy ceiling
measured on an H200 (docs/ BENCHMARKS.md). Each split-K setting is timed too, so the
automatic choice can be checked against the best fixed one.

Prefill: 8192 query tokens (one 8k prompt, and 8 prompts of 1k), causal, paged cache.
Figure: TFLOP/s counting 4 * head_dim FLOPs per (query, visible key, head) pair, beside
torch's scaled_dot_product_attention (flash) on the same problem laid out densely. And W3's
step: 64 new tokens over 8,000 cached (bandwidth-bound: K/V GB/s), split-KV automatic and off.

    python benchmarks/kernels_bench.py --sweep prefill --out prefill_sweep.json

`--sweep prefill` first times every candidate launch setting of
`atom_kernels.prefill_attention.PREFILL_CANDIDATES` on one 8k prompt with Llama-3.1-8B,
Qwen3-0.6B and Qwen3.5-4B (head_dim 256) heads against SDPA (`of_sdpa`: SDPA time / ours),
then split counts and heads per program on W3's step; `--sweep-budget-s` bounds it (about
two minutes in all on an H200, mostly compiles). `--sweep decode` retunes `decode_config`.

    python benchmarks/kernels_bench.py --sweep fp8 --sweep-only --out fp8_sweep.json

`--sweep fp8` times FP8 against bf16: the batch-1 GEMV (TB/s of weight bytes), `_scaled_mm` and
the Triton block GEMM against cuBLAS at 256 and 2,048 rows, W1's decode attention over an FP8
cache (`sweep_fp8`).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import platform
import random
import sys
import time

import torch
import triton

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


def _paged_cache(seq_lens, num_kv_heads, head_dim, block_size, dtype, heads_outer=False):
    """A cache with each sequence's blocks scattered at random, as after hours of serving.
    `heads_outer`: a block's memory holds each head's tokens together ([blocks, heads, page,
    dim]), returned as the usual [blocks, page, heads, dim] view with strides to match."""
    blocks_per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = sum(blocks_per_seq)
    if heads_outer:
        shape = (num_blocks, num_kv_heads, block_size, head_dim)
        k_cache = torch.randn(shape, dtype=dtype, device="cuda").transpose(1, 2)
        v_cache = torch.randn(shape, dtype=dtype, device="cuda").transpose(1, 2)
    else:
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


def bench_w3_step(model: str, prefix: int) -> list[dict]:
    """W3's attention step: 64 new tokens over a cached prefix, split-KV automatic and off."""
    problem = PrefillProblem(MODELS[model], [(prefix, 64)])
    rows = []
    for name, splits in (("auto", None), ("1", 1)):
        ms = problem.time_ms(num_splits=splits)
        rows.append(
            {"op": "prefill-w3", "model": model, "num_seqs": 1, "seq_len": f"64+{prefix}",
             "block_size": 16, "num_splits": name, "plan": problem.plan(num_splits=splits),
             "ms": round(ms, 4), "KV_GB_per_s": round(problem.kv_bytes / (ms * 1e-3) / 1e9, 1)}
        )  # fmt: skip
    return rows


def sweep_decode() -> list[dict]:
    """Decode launch settings around the defaults, to retune `decode_config`."""
    from atom_kernels import decode_attention

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
    return rows


def sweep_decode_w1() -> list[dict]:
    """W1's decode attention: batch 256 with Qwen3-0.6B heads over contexts of 512-1,024 tokens
    (seeded; W1's prompts of 512 plus up to 512 generated), unsplit as the engine launches it,
    both grid orders (`heads_fastest`) by launch settings; GB/s of K/V read, beside a plain
    reduction over the K cache (the read ceiling on the same bytes)."""
    from atom_kernels import decode_attention

    num_heads, num_kv_heads, head_dim = MODELS["qwen3-0.6b"]
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(0)
    seq_lens = torch.randint(512, 1025, (256,), generator=g).tolist()
    k_cache, v_cache, tables = _paged_cache(seq_lens, num_kv_heads, head_dim, 16, dtype)
    q = torch.randn(len(seq_lens), num_heads, head_dim, dtype=dtype, device="cuda")
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    kv_bytes = 2 * sum(seq_lens) * num_kv_heads * head_dim * 2
    read_ms = _time_ms(lambda: k_cache.view(-1).sum(dtype=torch.float32))
    rows = [{"op": "decode-w1", "kernel": "sum over k_cache", "ms": round(read_ms, 4),
             "GB_per_s": round(k_cache.numel() * 2 / (read_ms * 1e-3) / 1e9, 1)}]  # fmt: skip
    for heads_fastest in (False, True):
        for block_n, warps, stages in ((64, 4, 3), (64, 4, 2), (32, 4, 3), (128, 8, 3), (64, 8, 3),
                                       (32, 2, 3)):  # fmt: skip
            ms = _time_ms(
                functools.partial(
                    decode_attention.paged_attention_decode,
                    q, k_cache, v_cache, tables, lens, 0.1, num_splits=1, block_n=block_n,
                    num_warps=warps, num_stages=stages, heads_fastest=heads_fastest,
                )
            )  # fmt: skip
            rows.append(
                {"op": "decode-w1", "kernel": "heads fastest" if heads_fastest else "default",
                 "block_n": block_n, "warps": warps, "stages": stages, "ms": round(ms, 4),
                 "GB_per_s": round(kv_bytes / (ms * 1e-3) / 1e9, 1)}
            )  # fmt: skip
    return rows


def _w1_decode_case(generated: int, page: int = 16, heads_outer: bool = False):
    """W1's decode attention inputs at one point of the run: batch 256 with Qwen3-0.6B heads,
    W1's prompts (100-1,024 tokens, `random.Random(0)`) plus `generated` tokens each. Returns
    (k_cache, v_cache, {order: (q, block_tables, context_lens)}, K/V bytes read), the orders
    being "batch" (as the batch comes) and "longest first" (the same rows by context, longest
    first: what a per-step order would give)."""
    num_heads, num_kv_heads, head_dim = MODELS["qwen3-0.6b"]
    rng = random.Random(0)
    seq_lens = [rng.randint(100, 1024) + generated for _ in range(256)]
    k_cache, v_cache, tables = _paged_cache(
        seq_lens, num_kv_heads, head_dim, page, torch.bfloat16, heads_outer=heads_outer
    )
    q = torch.randn(len(seq_lens), num_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    idx = torch.argsort(lens, descending=True)
    orders = {"batch": (q, tables, lens),
              "longest first": (q[idx].contiguous(), tables[idx].contiguous(), lens[idx])}  # fmt: skip
    return k_cache, v_cache, orders, 2 * sum(seq_lens) * num_kv_heads * head_dim * 2


def _w1_decode(k_cache, v_cache, inputs, **launch) -> torch.Tensor:
    """One engine decode launch over `inputs` (q, block tables, context lengths); unsplit unless
    `launch` says otherwise."""
    from atom_kernels import decode_attention

    q, tables, lens = inputs
    launch.setdefault("num_splits", 1)
    return decode_attention.paged_attention_decode(q, k_cache, v_cache, tables, lens, 0.1, **launch)


def _time_w1_decode(k_cache, v_cache, inputs, kv_bytes, **launch) -> dict:
    """ms and K/V GB/s of `_w1_decode`."""
    ms = _time_ms(functools.partial(_w1_decode, k_cache, v_cache, inputs, **launch))
    return {"ms": round(ms, 4), "GB_per_s": round(kv_bytes / (ms * 1e-3) / 1e9, 1)}


def sweep_decode_w1_balance() -> list[dict]:
    """W1's decode attention with W1's own spread of contexts (prompts of 100-1,024 tokens plus
    0, 256 or 511 generated), by the order programs meet the sequences and by split count: as
    the batch comes, longest context first (what a per-step order would give), KV heads
    fastest, 2-4 splits, and a head's tokens together in a block (HND). The question: how much
    of the gap to the copy ceiling is the tail of a wave of unequal programs."""
    rows = []
    for generated, layout, page in itertools.product((0, 256, 511), ("NHD", "HND"), (16, 32)):
        if layout == "NHD" and page == 32:
            continue
        k_cache, v_cache, orders, kv_bytes = _w1_decode_case(generated, page, layout == "HND")
        if not rows:
            flat = k_cache.reshape(-1)
            read_ms = _time_ms(functools.partial(torch.mul, flat, 2.0, out=torch.empty_like(flat)))
            rows.append({"op": "decode-w1bal", "variant": "k_cache * 2 (read + write)",
                         "ms": round(read_ms, 4),
                         "GB_per_s": round(2 * flat.numel() * 2 / (read_ms * 1e-3) / 1e9, 1)})  # fmt: skip
            del flat
        for order, inputs in orders.items():
            for heads_fastest in (False, True):
                for splits in (1, 2, 4):
                    if splits > 1 and (heads_fastest or layout == "HND" or order == "batch"):
                        continue
                    timing = _time_w1_decode(k_cache, v_cache, inputs, kv_bytes,
                                             num_splits=splits, heads_fastest=heads_fastest)  # fmt: skip
                    rows.append({"op": "decode-w1bal", "generated": generated, "layout": layout,
                                 "page": page, "variant": order, "heads_fastest": heads_fastest,
                                 "splits": splits, **timing})  # fmt: skip
        del k_cache, v_cache, orders
        torch.cuda.empty_cache()
    return rows


def sweep_decode_w1_launch() -> list[dict]:
    """W1's decode attention (W1's spread of contexts, 0 and 256 generated, as batched and
    longest first) by launch settings: BLOCK_N, warps and stages decide how many programs an
    SM holds at once, and so how much of one program's start (its first loads' round trips)
    the others' streaming hides."""
    settings = ((64, 4, 3), (64, 4, 2), (32, 4, 3), (32, 4, 4), (32, 2, 3), (32, 2, 4),
                (16, 2, 4), (16, 1, 4), (64, 8, 2), (128, 8, 2))  # fmt: skip
    rows = []
    for generated in (0, 256):
        k_cache, v_cache, orders, kv_bytes = _w1_decode_case(generated)
        for order, inputs in orders.items():
            for block_n, warps, stages in settings:
                timing = _time_w1_decode(k_cache, v_cache, inputs, kv_bytes, block_n=block_n,
                                         num_warps=warps, num_stages=stages)  # fmt: skip
                rows.append({"op": "decode-w1launch", "generated": generated, "variant": order,
                             "block_n": block_n, "warps": warps, "stages": stages, **timing})  # fmt: skip
        del k_cache, v_cache, orders
        torch.cuda.empty_cache()
    return rows


def sweep_decode_w1_pack() -> list[dict]:
    """W1's decode attention (W1's spread of contexts, 0, 256 and 511 generated) by KV heads a
    program (`heads_per_program`: one as before, two as the engine now chooses at W1's batch,
    four, eight) and launch settings; each checked against one head a program."""
    runs = [(1, 64, 4, 3), (2, 64, 4, 2), (2, 32, 4, 3), (2, 32, 8, 3), (4, 16, 4, 3),
            (4, 32, 8, 2), (4, 16, 8, 4), (8, 16, 8, 2), (8, 16, 8, 3)]  # fmt: skip
    rows = []
    for generated in (0, 256, 511):
        k_cache, v_cache, orders, kv_bytes = _w1_decode_case(generated)
        decode = functools.partial(_w1_decode, k_cache, v_cache, orders["batch"])
        want = decode(heads_per_program=1).float()
        for heads, block_n, warps, stages in runs:
            launch = dict(heads_per_program=heads, block_n=block_n, num_warps=warps,
                          num_stages=stages)  # fmt: skip
            err = (decode(**launch).float() - want).abs().max().item()
            timing = _time_w1_decode(k_cache, v_cache, orders["batch"], kv_bytes, **launch)
            rows.append({"op": "decode-w1pack", "generated": generated, "heads": heads,
                         "block_n": block_n, "warps": warps, "stages": stages, **timing,
                         "max_err": round(err, 4)})  # fmt: skip
        del k_cache, v_cache, orders
        torch.cuda.empty_cache()
    return rows


def sweep_fp8() -> list[dict]:
    """FP8 against bf16, each on the same problem (`--sweep fp8`).

    gemv-fp8: the batch-1 GEMV on Llama-3.1-8B's and Qwen3-0.6B's projections (qkv, o, gate_up
    with SwiGLU, down, lm_head): bf16 (cuBLAS and the Triton GEMV) against FP8 weights with
    per-channel and 128 x 128 block scales (the rule's launch shape and each of
    `fp8_launch_candidates`). Each CUDA graph runs the product over distinct copies of the
    weight, at least 512 MB in all, so every weight streams from HBM as in a decode step.
    Figure: us a product and TB/s of weight bytes read (scales included).

    gemm-fp8: M = 256 and 2,048 rows through the same projections: bf16 cuBLAS, `_scaled_mm`
    rowwise on per-channel weights (the GEMM alone on quantized rows, then with the per-token
    quantization: `fp8_linear`), the Triton block-scaled GEMM (alone at a few launch shapes, and
    `fp8_linear` with the per-group quantization). Figure: TFLOP/s (2 M N K a product) and the
    largest error against the torch reference of the same quantization.

    decode-fp8: W1's decode attention (batch 256, contexts of 100-1,536 tokens, 16 query / 8 KV
    heads, head_dim 128, page 16) over a bf16 cache and over an FP8 cache (tensor scales, as a
    captured graph passes them) at a few launch settings. Figure: ms, GB/s of K/V bytes read,
    speedup over bf16."""
    import torch.nn.functional as F

    from atom_kernels import decode_attention, fp8_gemm, fp8_quant, gemv, reference
    from atom_kernels import fp8_formats as f8

    fp8 = f8.fp8_dtype_for_platform()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    projections = {
        "llama3-8b": {"qkv": (6144, 4096, None), "o": (4096, 4096, None),
                      "gate_up": (28672, 4096, "silu_mul"), "down": (4096, 14336, None),
                      "lm_head": (128256, 4096, None)},
        "qwen3-0.6b": {"qkv": (4096, 1024, None), "o": (1024, 2048, None),
                       "gate_up": (6144, 1024, "silu_mul"), "down": (1024, 3072, None),
                       "lm_head": (151936, 1024, None)},
    }  # fmt: skip

    def graph_ms(calls) -> float:
        """ms a replay of one CUDA graph of every call in `calls` (warmed up, so compiled)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for call in calls:
                call()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for call in calls:
                call()
        return _time_ms(graph.replay, warmup=3, iters=20)

    def gemv_rows() -> list[dict]:
        rows = []
        flat = [(model, name, *spec) for model, shapes in projections.items()
                for name, spec in shapes.items()]  # fmt: skip
        for model, name, n, k, act in flat:
            copies = max(2, -(-(512 << 20) // (n * k * 2)))
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            cases = [("bf16 cublas", [(w, None, None) for w in ws], None),
                     ("bf16 gemv", [(w, None, None) for w in ws], {})]  # fmt: skip
            for layout, quantize in (("fp8 channel", f8.quantize_weight_per_channel),
                                     ("fp8 block", f8.quantize_weight_block)):  # fmt: skip
                qs = [(*quantize(w, dtype=fp8), None) for w in ws]
                if layout == "fp8 block":
                    qs = [(q, s, (128, 128)) for q, s, _ in qs]
                cands = gemv.fp8_launch_candidates(n, k, sms, layout == "fp8 block")
                cases += [(layout, qs, c) for c in cands]
            del ws
            base = None
            for kernel, weights, launch in cases:
                read = sum(w.numel() * w.element_size() + (s.numel() * 4 if s is not None else 0)
                           for w, s, _ in weights)  # fmt: skip
                if launch is None:
                    calls = [functools.partial(F.linear, x, w) for w, _, _ in weights]
                else:
                    calls = [functools.partial(gemv.gemv, x, w, act=act, weight_scale=s,
                                               weight_block_size=b, **launch)
                             for w, s, b in weights]  # fmt: skip
                ms = graph_ms(calls)
                us = ms * 1e3 / len(weights)
                base = us if kernel == "bf16 gemv" else base
                shape = {key: launch[key] for key in ("block_n", "block_k", "split", "num_warps")
                         if launch}  # fmt: skip
                rows.append({"op": "gemv-fp8", "model": model, "proj": name, "n": n, "k": k,
                             "kernel": kernel, "launch": shape or "",
                             "us": round(us, 2), "TB_per_s": round(read / (ms * 1e-3) / 1e12, 3),
                             "x_bf16_gemv": round(base / us, 2) if base else ""})  # fmt: skip
            del cases, weights, calls
            torch.cuda.empty_cache()
        return rows

    def gemm_rows() -> list[dict]:
        rows = []
        configs = [None, {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 4},
                   {"block_m": 64, "block_n": 128, "num_warps": 4, "num_stages": 4}]  # fmt: skip
        for (model, shapes), m in itertools.product(projections.items(), (256, 2048)):
            for name, (n, k, _) in shapes.items():
                if name == "lm_head":
                    continue
                w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                wc, sc = f8.quantize_weight_per_channel(w, fp8)
                wb, sb = f8.quantize_weight_block(w, (128, 128), fp8)
                xc, xsc = fp8_quant.per_token_quant_fp8(x, fp8)
                xb, xsb = fp8_quant.per_token_group_quant_fp8(x, 128, fp8)
                cases = [("bf16 cublas", functools.partial(F.linear, x, w), None)]
                if fp8_gemm.scaled_mm_supported(x.device):
                    cases += [
                        ("scaled_mm rowwise", functools.partial(
                            fp8_gemm.scaled_mm, xc, wc, xsc, sc, torch.bfloat16), None),
                        ("fp8_linear channel", functools.partial(
                            fp8_gemm.fp8_linear, x, wc, sc), (wc, sc, None)),
                    ]  # fmt: skip
                for cfg in configs:
                    cases.append((f"block gemm {cfg or 'default'}", functools.partial(
                        fp8_gemm.w8a8_matmul, xb, wb, xsb, sb, torch.bfloat16, None, (128, 128),
                        config=cfg), None))  # fmt: skip
                cases.append(("fp8_linear block", functools.partial(
                    fp8_gemm.fp8_linear, x, wb, sb, weight_block_size=(128, 128)),
                    (wb, sb, (128, 128))))  # fmt: skip
                base = None
                for kernel, fn, checked in cases:
                    ms = _time_ms(fn)
                    base = ms if kernel == "bf16 cublas" else base
                    err = ""
                    if checked is not None:
                        want = reference.fp8_linear(x, checked[0], checked[1],
                                                    weight_block_size=checked[2])  # fmt: skip
                        err = round(((fn().float() - want.float()).abs().max()).item(), 4)
                    rows.append({"op": "gemm-fp8", "model": model, "proj": name, "m": m, "n": n,
                                 "k": k, "kernel": kernel, "ms": round(ms, 4),
                                 "TFLOP_per_s": round(2 * m * n * k / (ms * 1e-3) / 1e12, 1),
                                 "x_bf16": round(base / ms, 2), "max_err": err})  # fmt: skip
                del w, x, wc, wb, xc, xb, cases
                torch.cuda.empty_cache()
        return rows

    def decode_rows() -> list[dict]:
        num_heads, num_kv_heads, head_dim = MODELS["qwen3-0.6b"]
        rng = random.Random(0)
        seq_lens = [rng.randint(100, 1536) for _ in range(256)]
        k_cache, v_cache, tables = _paged_cache(seq_lens, num_kv_heads, head_dim, 16,
                                                torch.bfloat16)  # fmt: skip
        q = torch.randn(256, num_heads, head_dim, device="cuda", dtype=torch.bfloat16)
        lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
        k_scale = (k_cache.abs().amax().float() / f8.fp8_max(fp8)).reshape(1)
        v_scale = (v_cache.abs().amax().float() / f8.fp8_max(fp8)).reshape(1)
        k8 = reference.to_cache(k_cache, fp8, k_scale)
        v8 = reference.to_cache(v_cache, fp8, v_scale)
        tokens = sum(seq_lens) * num_kv_heads * head_dim * 2  # K and V elements
        decode = decode_attention.paged_attention_decode
        full = decode(q, k_cache, v_cache, tables, lens, head_dim**-0.5)
        runs = [("bf16", (k_cache, v_cache), {}), ("fp8", (k8, v8), {})]
        for heads, block_n, warps, stages in ((1, 64, 4, 3), (2, 64, 4, 2), (2, 128, 4, 2),
                                              (2, 128, 8, 2), (4, 64, 4, 2), (4, 32, 4, 3)):  # fmt: skip
            runs.append(("fp8", (k8, v8), dict(num_splits=1, heads_per_program=heads,
                                               block_n=block_n, num_warps=warps,
                                               num_stages=stages)))  # fmt: skip
        rows, base = [], None
        for cache, (kc, vc), launch in runs:
            scales = dict(k_scale=k_scale, v_scale=v_scale) if cache == "fp8" else {}
            fn = functools.partial(decode, q, kc, vc, tables, lens, head_dim**-0.5, **scales,
                                   **launch)  # fmt: skip
            ms = _time_ms(fn)
            base = ms if base is None else base
            err = ((fn().float() - full.float()).norm() / full.float().norm()).item()
            rows.append({"op": "decode-fp8", "cache": cache, "launch": launch or "default",
                         "ms": round(ms, 4),
                         "GB_per_s": round(tokens * kc.element_size() / (ms * 1e-3) / 1e9, 1),
                         "x_bf16": round(base / ms, 2), "rel_err_vs_bf16": round(err, 4)})  # fmt: skip
        return rows

    return gemv_rows() + gemm_rows() + decode_rows()


# Head shapes of the prefill sweep: (num_heads, num_kv_heads, head_dim).
SWEEP_HEADS = {
    "llama3-8b": (32, 8, 128),
    "qwen3-0.6b": (16, 8, 128),
    "qwen3.5-4b": (16, 4, 256),  # its full-attention layers
}


class PrefillProblem:
    """A paged prefill batch on the GPU, given (cached prefix, chunk) per sequence, with its
    FLOPs (4 * head_dim per visible (query, key, head) pair) and K/V bytes (each sequence's
    keys and values read once)."""

    def __init__(self, heads: tuple[int, int, int], shapes: list[tuple[int, int]],
                 block_size: int = 16) -> None:  # fmt: skip
        num_heads, num_kv_heads, head_dim = heads
        self.heads = heads
        seq_lens = [p + c for p, c in shapes]
        q_lens = [c for _, c in shapes]
        k_cache, v_cache, tables = _paged_cache(
            seq_lens, num_kv_heads, head_dim, block_size, torch.bfloat16
        )
        total = sum(q_lens)
        q = torch.randn(total, num_heads, head_dim, dtype=torch.bfloat16, device="cuda")
        cu = torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32)
        lens = torch.tensor(seq_lens, dtype=torch.int32)
        self.args = (q, k_cache, v_cache, cu.cuda(), lens.cuda(), tables, head_dim**-0.5,
                     max(q_lens))  # fmt: skip
        self.out = torch.empty_like(q)
        pairs = sum(c * p + c * (c + 1) // 2 for p, c in shapes)
        self.flops = 4 * pairs * num_heads * head_dim
        self.kv_bytes = 2 * sum(seq_lens) * num_kv_heads * head_dim * 2
        self.shapes = shapes

    def time_ms(self, **launch) -> float:
        from atom_kernels import prefill_attention

        return _time_ms(
            lambda: prefill_attention.paged_attention_prefill(*self.args, self.out, **launch)
        )

    def plan(self, **launch) -> str:
        """The launch `paged_attention_prefill` makes of this problem, in short."""
        from atom_kernels import decode_attention, prefill_attention

        q, k_cache, *_ = self.args
        p = prefill_attention.plan_prefill_launch(
            num_heads=q.shape[1],
            num_kv_heads=k_cache.shape[2],
            head_dim=q.shape[2],
            page_size=k_cache.shape[1],
            batch=len(self.shapes),
            max_seqlen_q=self.args[7],
            max_context=self.args[5].shape[1] * k_cache.shape[1],
            num_multiprocessors=decode_attention._multiprocessor_count(q.device),
            **launch,
        )
        return (
            f"{p.block_m}x{p.block_n} w{p.num_warps} s{p.num_stages} P{p.heads_per_program} "
            f"S{p.num_splits} {p.kv_lookup}"
            + (f" range{p.loop_stages}" if p.loop_stages else "")
            + (" ws" if p.warp_specialize else "")
        )

    def max_error(self) -> float:
        """Largest absolute difference of the last timed output from the torch reference
        (bf16 outputs of unit-variance inputs: expect about 1e-2 or less)."""
        from atom_kernels import reference

        if not hasattr(self, "_want"):
            self._want = reference.paged_attention_prefill(*self.args)
        return (self.out.float() - self._want.float()).abs().max().item()

    def sdpa_ms(self) -> float:
        """torch SDPA (flash) on dense tensors of the same problem, one sequence: causal for a
        whole prompt; for a chunk over a cached prefix, non-causal (its queries see every key
        but the last chunk's upper triangle: nearly the same work), K/V as GQA when torch
        takes `enable_gqa`, else repeated to every query head."""
        if len(self.shapes) != 1:
            raise ValueError("the SDPA peer is timed for one sequence")
        (prefix, chunk), = self.shapes  # fmt: skip
        num_heads, num_kv_heads, head_dim = self.heads
        dtype = torch.bfloat16
        qd = torch.randn(1, num_heads, chunk, head_dim, dtype=dtype, device="cuda")
        kd = torch.randn(1, num_kv_heads, prefix + chunk, head_dim, dtype=dtype, device="cuda")
        vd = torch.randn_like(kd)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        causal = prefix == 0
        try:
            sdpa(qd, kd, vd, is_causal=causal, enable_gqa=True)
            return _time_ms(lambda: sdpa(qd, kd, vd, is_causal=causal, enable_gqa=True))
        except (TypeError, RuntimeError):
            group = num_heads // num_kv_heads
            kd, vd = kd.repeat_interleave(group, 1), vd.repeat_interleave(group, 1)
            return _time_ms(lambda: sdpa(qd, kd, vd, is_causal=causal))


def sweep_prefill(budget_s: float) -> list[dict]:
    """W3's step (64 new tokens over 8,000 cached): split counts, heads per program and
    `SHORT_CHUNK_CANDIDATES`; then every candidate of `PREFILL_CANDIDATES` on one
    8,192-token prompt per head shape, against SDPA. Stops starting new timings once
    `budget_s` seconds have passed (compiles dominate), listing what it skipped. Llama-8B and
    Qwen3-0.6B heads share compiled kernels (the GQA group is a runtime argument)."""
    from triton.runtime.errors import OutOfResources

    from atom_kernels import prefill_attention as pa

    began = time.perf_counter()
    rows: list[dict] = []
    skipped: list[str] = []

    def timed(workload: str, problem: PrefillProblem, name: str, sdpa_ms: float | None,
              launch: dict) -> None:  # fmt: skip
        label = f"{workload} {name}"
        if time.perf_counter() - began > budget_s:
            skipped.append(label)
            return
        if launch.get("warp_specialize") and not pa.HAS_WARP_SPECIALIZE:
            skipped.append(f"{label} (Triton {triton.__version__} has no warp_specialize)")
            return
        try:
            ms = problem.time_ms(**launch)
        except OutOfResources as e:  # this tiling does not fit the device's shared memory
            print(f"prefill {label}: {e}", file=sys.stderr)
            return
        except Exception as e:  # a setting this Triton cannot compile: report, go on
            print(f"prefill {label}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
            return
        row = {"op": "prefill", "workload": workload, "config": name,
               "plan": problem.plan(**launch), "ms": round(ms, 4),
               "TFLOP_per_s": round(problem.flops / (ms * 1e-3) / 1e12, 1),
               "KV_GB_per_s": round(problem.kv_bytes / (ms * 1e-3) / 1e9, 1),
               "max_err": round(problem.max_error(), 4)}  # fmt: skip
        if sdpa_ms is not None:
            row["of_sdpa"] = round(sdpa_ms / ms, 3)
        rows.append(row)

    # W3's step first (issue 18's target), then the long prompts.
    for model in ("qwen3-0.6b", "qwen3.5-4b"):
        heads = SWEEP_HEADS[model]
        problem = PrefillProblem(heads, [(8000, 64)])
        sdpa_ms = problem.sdpa_ms()
        workload = f"{model} W3 64+8000"
        rows.append({"op": "prefill", "workload": workload, "config": "sdpa-dense-noncausal",
                     "ms": round(sdpa_ms, 4),
                     "KV_GB_per_s": round(problem.kv_bytes / (sdpa_ms * 1e-3) / 1e9, 1)})  # fmt: skip
        variants = [("default auto-splits", {}), ("default splits=1", dict(num_splits=1))]
        if model == "qwen3-0.6b":
            variants += [(f"default splits={s}", dict(num_splits=s)) for s in (4, 8, 16, 32)]
            variants += [("default heads_per_program=1", dict(heads_per_program=1))]
        bucket = 128 if heads[2] <= 128 else 256
        variants += [(f"{name} auto-splits", launch)
                     for name, launch in pa.SHORT_CHUNK_CANDIDATES[bucket]]  # fmt: skip
        for name, launch in variants:
            timed(workload, problem, name, sdpa_ms, launch)
        del problem
    for model, heads in SWEEP_HEADS.items():
        problem = PrefillProblem(heads, [(0, 8192)])
        sdpa_ms = problem.sdpa_ms()
        workload = f"{model} 8k"
        rows.append({"op": "prefill", "workload": workload, "config": "sdpa-dense",
                     "ms": round(sdpa_ms, 4),
                     "TFLOP_per_s": round(problem.flops / (sdpa_ms * 1e-3) / 1e12, 1)})  # fmt: skip
        timed(workload, problem, "default", sdpa_ms, {})
        bucket = 128 if heads[2] <= 128 else 256
        for name, launch in pa.PREFILL_CANDIDATES[bucket]:
            timed(workload, problem, name, sdpa_ms, launch)
        del problem
    torch.cuda.empty_cache()
    if skipped:
        print(f"prefill sweep: over its {budget_s:.0f} s budget, skipped: {skipped}",
              file=sys.stderr)  # fmt: skip
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
    parser.add_argument(
        "--sweep",
        nargs="?",
        const="all",
        choices=("all", "decode", "prefill", "w1", "w1bal", "w1launch", "w1pack", "fp8"),
        help="also sweep launch settings (decode, prefill, all, w1: W1's decode attention, or "
        "w1bal: W1's decode attention by program order and split count, w1launch: by launch "
        "settings, w1pack: by KV heads a program); fp8: FP8 GEMV, GEMMs and decode attention "
        "against bf16 (not in all)",
    )
    parser.add_argument(
        "--sweep-only", action="store_true", help="stop after the sweep (no main benchmark)"
    )
    parser.add_argument(
        "--sweep-budget-s",
        type=float,
        default=100.0,
        help="the prefill sweep starts no new timing after this many seconds",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernels_bench needs a CUDA or ROCm GPU; none is present", file=sys.stderr)
        return 2
    sweep_rows = []
    if args.sweep in ("all", "decode"):
        sweep_rows += sweep_decode()
        _print_table([r for r in sweep_rows if r["op"] == "decode"])
    if args.sweep in ("all", "decode", "w1"):
        sweep_rows += sweep_decode_w1()
        _print_table([r for r in sweep_rows if r["op"] == "decode-w1"])
    for name, sweep in (("w1bal", sweep_decode_w1_balance), ("w1launch", sweep_decode_w1_launch),
                        ("w1pack", sweep_decode_w1_pack)):  # fmt: skip
        if args.sweep == name:
            sweep_rows += sweep()
            _print_table([r for r in sweep_rows if r["op"] == f"decode-{name}"])
    if args.sweep == "fp8":
        fp8_rows = sweep_fp8()
        sweep_rows += fp8_rows
        for op in dict.fromkeys(r["op"] for r in fp8_rows):
            _print_table([r for r in fp8_rows if r["op"] == op])
    if args.sweep in ("all", "prefill"):
        prefill_sweep = sweep_prefill(args.sweep_budget_s)
        sweep_rows += prefill_sweep
        for workload in dict.fromkeys(r["workload"] for r in prefill_sweep):
            _print_table([r for r in prefill_sweep if r["workload"] == workload])
    if args.sweep_only:
        _write(args.out, {"sweep": sweep_rows})
        return 0

    batch, context, prefill_len = (4, 512, 1024) if args.quick else (64, 4096, 8192)
    decode_rows, prefill_rows = [], []
    for model in MODELS:
        for block_size in (16, 128):
            decode_rows += bench_decode(model, batch, context, block_size, args.quick)
        prefill_rows += bench_prefill(model, 1, prefill_len, 16)
        prefill_rows += bench_prefill(model, 8, prefill_len // 8, 16)
        prefill_rows += bench_w3_step(model, 8000 if not args.quick else 1000)
    _print_table(decode_rows)
    _print_table(prefill_rows)

    result = {
        "copy_ceiling_GB_per_s": COPY_CEILING_BYTES_PER_S / 1e9,
        "decode": decode_rows,
        "prefill": prefill_rows,
        "sweep": sweep_rows,
    }
    _write(args.out, result)
    return 0


def _write(path: str, result: dict) -> None:
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "hip": torch.version.hip,
        "python": platform.python_version(),
        **result,
    }
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())

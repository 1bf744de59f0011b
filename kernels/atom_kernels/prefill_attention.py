"""Triton paged attention for prefill (and any mixed batch): packed variable-length query
chunks attending causally to their sequence's paged KV cache.

Grid: (head block, query tile x split, sequence). A program owns BLOCK_M rows: BLOCK_Q
consecutive queries of one chunk times HEADS_PER_PROG query heads of one KV group
(query-major: row r is query r // HEADS_PER_PROG, head r % HEADS_PER_PROG), so a short chunk
still fills the tile and each K/V tile it loads serves every head of the block. It sweeps
the keys BLOCK_N at a time with `tl.dot` for QK^T and PV and an online softmax in fp32. The
sweep has two phases: keys before the tile's first query position are visible to every row
and need no mask; the keys from there up to the tile's last query position get the causal
mask. Keys past the tile's last query are never visited (fully masked tiles are skipped).
Query tiles are launched longest-first (the last tile of a chunk sees the most keys) so the
tail of the launch is short work; head blocks of one KV group are neighbours in launch
order, so their shared K/V tiles hit in L2.

Split-KV (flash-decoding style): when heads x tiles x sequences would leave the GPU
underused and the contexts are long (a short chunk over a long cached prefix), each tile's
key range [0, last query position] is cut into `num_splits` ranges (a multiple of BLOCK_N
each) processed by separate programs. Each writes its unnormalised partial output, its
running max (log2 domain) and its sum; a split past the tile's range writes max -inf and sum
0. A second kernel merges the splits of each (token, head) by log-sum-exp. The split count
is chosen on the host from shapes only (`block_tables.shape[1]`, `max_seqlen_q`, the batch
and the device), so there is no device-to-host sync and a captured launch stays valid; the
partial buffers come from the torch allocator (a graph capture takes them from its pool).

Sliding window and sinks (GPT-OSS, Mistral): with WINDOW > 0 a tile's keys start at its first
query's window (rounded down to a tile; keys before it are masked as they load, so a block a
windowed layer has given back is never read) and every tile takes the masked path, each row
seeing only its own last WINDOW positions. A sink is a per-head logit joined to the softmax's
denominator at the end (or in the merge of splits).

K/V rows are gathered through the block table. How the table is read is a launch setting
(`kv_lookup`): "tile" (the page holds the whole BLOCK_N tile: one lookup per tile, any page
that is a multiple of BLOCK_N), "page" (BLOCK_N spans whole pages: one lookup per page, the
tile loaded as [pages, page, head_dim] and viewed as [BLOCK_N, head_dim]), or "row" (one
lookup per key row: any page size, including ones that do not divide the tile).

FP8 cache (per-tensor k_scale, v_scale): tiles are read as FP8 and converted to q's dtype for
the dots, k_scale folded into the softmax scale, v_scale applied to the accumulator once, as in
`decode_attention`; a cache of q's dtype compiles none of it.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from atom_kernels.decode_attention import _add_sink, _multiprocessor_count, paged_output
from atom_kernels.fp8_formats import is_fp8
from atom_kernels.fp8_quant import load_scale, scale_arg

_LOG2E = 1.4426950408889634

# Split-KV: fewest keys a split should cover (below this the merge costs more than it
# saves), and the most splits of one tile.
_MIN_TOKENS_PER_SPLIT = 256
_MAX_SPLITS = 32

_KV_LOOKUPS = {"row": 0, "page": 1, "tile": 2}


def _triton_version() -> tuple[int, int]:
    major, minor = triton.__version__.split(".")[:2]
    return int(major), int(minor)


# `tl.range(..., warp_specialize=...)` exists from Triton 3.4 (documented for Blackwell).
HAS_WARP_SPECIALIZE = _triton_version() >= (3, 4)


@triton.jit
def _load_kv_tile(
    cache_ptr, bt_row, head_off, cache_stride_block, cache_stride_off, tile, kv_start, kv_end,
    offs_n, offs_d, d_mask, MASKED: tl.constexpr, PAD_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, KV_LOOKUP: tl.constexpr,
):  # fmt: skip
    """The [BLOCK_N, BLOCK_D] tile of keys (or values) at positions tile..tile+BLOCK_N-1 of
    one KV head; positions before kv_start or at or past kv_end read as zeros when MASKED."""
    # One return at the end (no early returns: every Triton version compiles this form).
    if KV_LOOKUP == 1:
        # Whole pages: one block-table entry per page, a 3-D gather viewed as 2-D.
        NUM_PAGES: tl.constexpr = BLOCK_N // PAGE_SIZE
        offs_p = tl.arange(0, PAGE_SIZE)
        page = tile // PAGE_SIZE + tl.arange(0, NUM_PAGES)
        if MASKED:
            block = tl.load(bt_row + page, mask=page * PAGE_SIZE < kv_end, other=0)
        else:
            block = tl.load(bt_row + page)
        base = block.to(tl.int64) * cache_stride_block + head_off
        ptrs = (
            cache_ptr
            + base[:, None, None]
            + (offs_p * cache_stride_off)[None, :, None]
            + offs_d[None, None, :]
        )
        if MASKED:
            pos = (page * PAGE_SIZE)[:, None] + offs_p[None, :]
            mask = ((pos >= kv_start) & (pos < kv_end))[:, :, None] & d_mask[None, None, :]
            kv3 = tl.load(ptrs, mask=mask, other=0.0)
        elif PAD_D:
            kv3 = tl.load(ptrs, mask=d_mask[None, None, :], other=0.0)
        else:
            kv3 = tl.load(ptrs)
        kv = tl.reshape(kv3, (BLOCK_N, BLOCK_D))
    else:
        pos = tile + offs_n
        if KV_LOOKUP == 2:
            # The tile lies inside one page (tiles start at multiples of BLOCK_N, which
            # divides the page): one scalar lookup.
            block = tl.load(bt_row + tile // PAGE_SIZE).to(tl.int64)
            rows = block * cache_stride_block + (pos % PAGE_SIZE) * cache_stride_off
        else:
            if MASKED:
                block = tl.load(bt_row + pos // PAGE_SIZE, mask=pos < kv_end, other=0)
            else:
                block = tl.load(bt_row + pos // PAGE_SIZE)
            rows = block.to(tl.int64) * cache_stride_block + (pos % PAGE_SIZE) * cache_stride_off
        ptrs = cache_ptr + (rows + head_off)[:, None] + offs_d[None, :]
        if MASKED:
            inside = (pos >= kv_start) & (pos < kv_end)
            kv = tl.load(ptrs, mask=inside[:, None] & d_mask[None, :], other=0.0)
        elif PAD_D:
            kv = tl.load(ptrs, mask=d_mask[None, :], other=0.0)
        else:
            kv = tl.load(ptrs)
    return kv


@triton.jit
def _attend_tile(
    q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, bt_row, head_off, cache_stride_block,
    cache_stride_off, tile, q_pos, kv_start, kv_end, scale_log2, offs_n, offs_d, d_mask,
    CAUSAL: tl.constexpr, PAD_D: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, KV_LOOKUP: tl.constexpr, IEEE_DOT: tl.constexpr, WINDOW: tl.constexpr,
):  # fmt: skip
    k = _load_kv_tile(
        k_cache_ptr, bt_row, head_off, cache_stride_block, cache_stride_off, tile, kv_start,
        kv_end, offs_n, offs_d, d_mask, CAUSAL, PAD_D, PAGE_SIZE, BLOCK_N, BLOCK_D, KV_LOOKUP,
    ).to(q.dtype)  # fmt: skip
    if IEEE_DOT:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if CAUSAL:
        pos = tile + offs_n
        seen = pos[None, :] <= q_pos[:, None]
        if WINDOW > 0:
            seen = seen & (pos[None, :] > q_pos[:, None] - WINDOW)
        s = tl.where(seen, s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row whose keys so far are all masked keeps m = -inf; exp2(-inf - -inf) is NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
    else:
        # Every key is visible to every row (padding rows have q = 0): m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * scale_log2)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s * scale_log2 - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = _load_kv_tile(
        v_cache_ptr, bt_row, head_off, cache_stride_block, cache_stride_off, tile, kv_start,
        kv_end, offs_n, offs_d, d_mask, CAUSAL, PAD_D, PAGE_SIZE, BLOCK_N, BLOCK_D, KV_LOOKUP,
    ).to(q.dtype)  # fmt: skip
    acc = acc * alpha[:, None]
    if IEEE_DOT:
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_new, l_i


@triton.jit
def _sweep_keys(
    lo, hi, q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, bt_row, head_off, cache_stride_block,
    cache_stride_off, q_pos, kv_start, kv_end, scale_log2, offs_n, offs_d, d_mask,
    CAUSAL: tl.constexpr, PAD_D: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, KV_LOOKUP: tl.constexpr, LOOP_STAGES: tl.constexpr,
    WARP_SPEC: tl.constexpr, IEEE_DOT: tl.constexpr, WINDOW: tl.constexpr,
):  # fmt: skip
    """Tiles lo, lo + BLOCK_N, ... below hi. LOOP_STAGES > 0 pipelines the loop with
    `tl.range(num_stages=...)` (every load of the loop, the block-table reads included);
    WARP_SPEC asks for automatic warp specialization (Triton >= 3.4)."""
    if WARP_SPEC:
        for tile in tl.range(lo, hi, BLOCK_N, warp_specialize=True):
            acc, m_i, l_i = _attend_tile(
                q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, bt_row, head_off,
                cache_stride_block, cache_stride_off, tile, q_pos, kv_start, kv_end,
                scale_log2, offs_n, offs_d, d_mask, CAUSAL, PAD_D, PAGE_SIZE, BLOCK_N,
                BLOCK_D, KV_LOOKUP, IEEE_DOT, WINDOW,
            )  # fmt: skip
    elif LOOP_STAGES > 0:
        for tile in tl.range(lo, hi, BLOCK_N, num_stages=LOOP_STAGES):
            acc, m_i, l_i = _attend_tile(
                q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, bt_row, head_off,
                cache_stride_block, cache_stride_off, tile, q_pos, kv_start, kv_end,
                scale_log2, offs_n, offs_d, d_mask, CAUSAL, PAD_D, PAGE_SIZE, BLOCK_N,
                BLOCK_D, KV_LOOKUP, IEEE_DOT, WINDOW,
            )  # fmt: skip
    else:
        for tile in range(lo, hi, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, bt_row, head_off,
                cache_stride_block, cache_stride_off, tile, q_pos, kv_start, kv_end,
                scale_log2, offs_n, offs_d, d_mask, CAUSAL, PAD_D, PAGE_SIZE, BLOCK_N,
                BLOCK_D, KV_LOOKUP, IEEE_DOT, WINDOW,
            )  # fmt: skip
    return acc, m_i, l_i


# Lengths that change every step are not specialised on (each value class would compile anew).
# The block table's row stride is the widest table of the step: left unspecialised, so steps of
# any width share one compiled kernel (a start-up warm-up compiles every variant, below).
@triton.jit(do_not_specialize=["num_splits", "num_tokens", "bt_stride_b"])
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    cu_seqlens_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    sinks_ptr,
    scale_log2,
    num_splits,
    num_tokens,
    q_stride_t,
    q_stride_h,
    out_stride_t,
    out_stride_h,
    cache_stride_block,
    cache_stride_off,
    cache_stride_h,
    bt_stride_b,
    group,  # query heads per KV head; a runtime value, so models share compiled kernels
    k_scale,
    v_scale,
    HEADS_PER_PROG: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr,
    KV_LOOKUP: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
    WARP_SPEC: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    FP8: tl.constexpr = False,
    K_SCALE_PTR: tl.constexpr = False,
    V_SCALE_PTR: tl.constexpr = False,
    WINDOW: tl.constexpr = 0,
    HAS_SINKS: tl.constexpr = False,
):
    BLOCK_Q: tl.constexpr = BLOCK_M // HEADS_PER_PROG
    head_block = tl.program_id(0)
    num_heads = tl.num_programs(0) * HEADS_PER_PROG
    if SPLIT:
        split = tl.program_id(1) % num_splits
        tile_id = tl.program_id(1) // num_splits
        num_tiles = tl.num_programs(1) // num_splits
    else:
        split = 0
        tile_id = tl.program_id(1)
        num_tiles = tl.num_programs(1)
    m_block = num_tiles - 1 - tile_id  # longest tiles first
    seq = tl.program_id(2)

    q_start = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_start
    m0 = m_block * BLOCK_Q
    if m0 < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        first_pos = seq_len - q_len  # absolute position of the chunk's first query

        offs_m = tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        qi = m0 + offs_m // HEADS_PER_PROG  # query index within the chunk
        heads = head_block * HEADS_PER_PROG + offs_m % HEADS_PER_PROG
        m_mask = qi < q_len
        d_mask = offs_d < HEAD_DIM
        q_pos = first_pos + qi
        tokens = (q_start + qi).to(tl.int64)

        q_ptrs = q_ptr + tokens[:, None] * q_stride_t + heads[:, None] * q_stride_h
        q = tl.load(q_ptrs + offs_d[None, :], mask=m_mask[:, None] & d_mask[None, :], other=0.0)
        if FP8:
            scale_log2 = scale_log2 * load_scale(k_scale, K_SCALE_PTR)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        bt_row = block_tables_ptr + seq.to(tl.int64) * bt_stride_b
        head_off = ((head_block * HEADS_PER_PROG) // group).to(tl.int64) * cache_stride_h
        kv_end = first_pos + tl.minimum(q_len, m0 + BLOCK_Q)  # last query's position + 1
        # Keys before first_pos + m0 precede every query of the tile: no mask needed. Under a
        # window the tile's keys start at its first query's window, and every tile is masked.
        if WINDOW > 0:
            kv_start = tl.maximum(first_pos + m0 - WINDOW + 1, 0)
            lo = (kv_start // BLOCK_N) * BLOCK_N
            unmasked_end = lo
        else:
            kv_start = first_pos * 0
            lo = kv_start
            unmasked_end = ((first_pos + m0) // BLOCK_N) * BLOCK_N
        if SPLIT:
            # This split's share of [lo, kv_end), cut at multiples of BLOCK_N.
            per_split = tl.cdiv(tl.cdiv(kv_end - lo, num_splits), BLOCK_N) * BLOCK_N
            start = lo + split * per_split
            end = tl.minimum(kv_end, start + per_split)
        else:
            start = lo
            end = kv_end
        PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
        acc, m_i, l_i = _sweep_keys(
            start, tl.minimum(end, unmasked_end), q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr,
            bt_row, head_off, cache_stride_block, cache_stride_off, q_pos, kv_start, kv_end,
            scale_log2, offs_n, offs_d, d_mask, False, PAD_D, PAGE_SIZE, BLOCK_N, BLOCK_D,
            KV_LOOKUP, LOOP_STAGES, WARP_SPEC, IEEE_DOT, WINDOW,
        )  # fmt: skip
        acc, m_i, l_i = _sweep_keys(
            tl.maximum(start, unmasked_end), end, q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr,
            bt_row, head_off, cache_stride_block, cache_stride_off, q_pos, kv_start, kv_end,
            scale_log2, offs_n, offs_d, d_mask, True, PAD_D, PAGE_SIZE, BLOCK_N, BLOCK_D,
            KV_LOOKUP, LOOP_STAGES, WARP_SPEC, IEEE_DOT, WINDOW,
        )  # fmt: skip
        if FP8:  # the split partials too: the merge is linear in them
            acc = acc * load_scale(v_scale, V_SCALE_PTR)

        store_mask = m_mask[:, None] & d_mask[None, :]
        if SPLIT:
            # Partial buffers: max and sum [num_splits, T, num_heads], acc [..., HEAD_DIM].
            # A split past the tile's keys stores max -inf and sum 0 (its acc is not read).
            row = (split * num_tokens + tokens) * num_heads + heads
            tl.store(part_max_ptr + row, m_i, mask=m_mask)
            tl.store(part_sum_ptr + row, l_i, mask=m_mask)
            acc_ptrs = part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :]
            tl.store(acc_ptrs, acc, mask=store_mask)
        else:
            if HAS_SINKS:
                sink = tl.load(sinks_ptr + heads).to(tl.float32) * 1.4426950408889634
                acc, l_i = _add_sink(acc, m_i, l_i, sink)
            o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            o_ptrs = out_ptr + tokens[:, None] * out_stride_t + heads[:, None] * out_stride_h
            tl.store(o_ptrs + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=store_mask)


@triton.jit(do_not_specialize=["num_seqs", "num_splits"])
def _prefill_merge_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, cu_seqlens_ptr, sinks_ptr, num_seqs,
    num_splits, out_stride_t, out_stride_h, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr, HAS_SINKS: tl.constexpr = False,
):  # fmt: skip
    """One program per (token, head): out = sum_s 2^(m_s - m) acc_s / sum_s 2^(m_s - m) l_s.
    Rows past the last chunk (padding tokens) are left as they are, as the unsplit kernel
    leaves them."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    num_tokens = tl.num_programs(0)
    num_heads = tl.num_programs(1)
    if token < tl.load(cu_seqlens_ptr + num_seqs):
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        row = (offs_s.to(tl.int64) * num_tokens + token) * num_heads + head
        m = tl.load(part_max_ptr + row, mask=offs_s < num_splits, other=float("-inf"))
        live = m > float("-inf")  # some split is: every query sees itself
        l_part = tl.load(part_sum_ptr + row, mask=live, other=0.0)
        acc_ptrs = part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :]
        acc = tl.load(acc_ptrs, mask=live[:, None] & d_mask[None, :], other=0.0)
        m_max = tl.max(m, axis=0)
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
            m_max = tl.maximum(m_max, sink)
        w = tl.where(live, tl.exp2(m - m_max), 0.0)
        total = tl.sum(l_part * w, axis=0)
        if HAS_SINKS:
            total += tl.exp2(sink - m_max)
        o = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
        o_ptrs = out_ptr + token.to(tl.int64) * out_stride_t + head * out_stride_h + offs_d
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=d_mask)


# -- launch settings -----------------------------------------------------------------------------

# Defaults by (vendor, head_dim bucket): "cuda" or "hip"; buckets 128 (head_dim <= 128) and
# 256. `kv_lookup` "auto" takes "tile" when the page is a multiple of BLOCK_N, "row"
# otherwise. An entry's "short_chunks" dict overrides it for launches whose chunks are all at
# most SHORT_CHUNK_TOKENS long (W3's 64 new tokens over a long cached prefix: one query tile
# per chunk, split-KV, bandwidth-bound). Retune from `benchmarks/kernels_bench.py --sweep
# prefill` (PREFILL_CANDIDATES for long prompts, its W3 rows for short chunks).
#
# Compiled for sm_90 (Triton 3.9, no GPU): BLOCK_M 128 with 4 warps holds a 128 x head_dim
# fp32 accumulator in one warpgroup and spills (~250 bytes of stack at head_dim 128); 8 warps
# do not; K/V gathers are pipelined with cp.async (num_stages - 1 buffers).
#
# H200, bf16, one 8k prompt, 32 q / 8 KV heads, head_dim 128 (before this table): 128x64
# tiles, 4 warps, 3 stages ran at ~370 TFLOP/s; 8 warps ~300, 128x128 ~350, 64x64 ~330.
# head_dim 256 halves both tiles to keep K, V and the accumulator within shared memory and
# registers. MI300 (64-wide wavefronts): its stream pipeliner wants 2 stages.
SHORT_CHUNK_TOKENS = 128

PREFILL_DEFAULTS: dict[tuple[str, int], dict] = {
    ("cuda", 128): dict(block_m=128, block_n=64, num_warps=4, num_stages=3),
    ("cuda", 256): dict(block_m=64, block_n=32, num_warps=4, num_stages=2),
    ("hip", 128): dict(block_m=128, block_n=64, num_warps=4, num_stages=2),
    ("hip", 256): dict(block_m=64, block_n=32, num_warps=4, num_stages=2),
}


def _candidates(names: str) -> list[tuple[str, dict]]:
    """Launch candidates from their names, `{block_m}x{block_n}w{num_warps}s{num_stages}` and an
    optional suffix: `-page` (kv_lookup="page"), `-range{n}` (loop_stages=n), `-gqa{n}`
    (heads_per_program=n)."""
    suffixes = {
        "page": ("kv_lookup", None),
        "range": ("loop_stages", int),
        "gqa": ("heads_per_program", int),
    }
    out = []
    for name in names.split():
        base, _, suffix = name.partition("-")
        m, n, w, st = re.fullmatch(r"(\d+)x(\d+)w(\d+)s(\d+)", base).groups()
        launch = dict(block_m=int(m), block_n=int(n), num_warps=int(w), num_stages=int(st))
        if suffix:
            key, kind = re.fullmatch(r"([a-z]+)(\d*)", suffix).groups()
            field, cast = suffixes[key]
            launch[field] = suffix if cast is None else cast(kind)
        out.append((name, launch))
    return out


# Candidates the sweep times against SDPA, by head_dim bucket. Each is a set of keyword
# overrides of `paged_attention_prefill`; the name is what the sweep prints.
PREFILL_CANDIDATES: dict[int, list[tuple[str, dict]]] = {
    128: _candidates(
        "128x64w4s3 128x64w4s2 128x64w8s3 128x64w8s4 128x128w8s2 128x128w8s3 128x32w4s4 "
        "64x64w4s3 64x128w4s2 64x128w4s3 256x64w8s2 128x64w4s3-page 128x128w8s3-page "
        "128x64w4s3-range3 128x128w8s3-range3 128x64w4s3-gqa2 128x64w8s3-gqa2"
    ),
    256: _candidates(
        "64x32w4s2 64x32w4s3 64x64w4s2 64x64w8s2 64x64w8s3 128x32w8s2 128x64w8s2 64x32w4s2-page"
    ),
}

# Whole-config candidates for short chunks (W3's step), timed by the sweep with automatic
# splits; the winner goes into PREFILL_DEFAULTS[...]["short_chunks"].
SHORT_CHUNK_CANDIDATES: dict[int, list[tuple[str, dict]]] = {
    128: _candidates("128x64w4s3 128x64w8s3 128x128w8s3 64x64w4s3 64x128w4s3"),
    256: _candidates("64x32w4s2 64x64w8s2"),
}


def _head_dim_bucket(head_dim: int) -> int:
    return 128 if triton.next_power_of_2(head_dim) <= 128 else 256


def prefill_config(head_dim: int, max_seqlen_q: int | None = None) -> dict:
    """The default launch settings for this head_dim on this vendor's GPUs (a copy), for a
    launch whose chunks are at most max_seqlen_q long (None: long prompts)."""
    short = max_seqlen_q is not None and max_seqlen_q <= SHORT_CHUNK_TOKENS
    return dict(_defaults(head_dim, torch.version.hip is not None, short))


@functools.lru_cache(maxsize=32)
def _defaults(head_dim: int, hip: bool, short: bool) -> dict:
    """The launch path's settings: the entry for this head_dim and vendor, with its
    "short_chunks" overrides applied when every chunk is short; looked up once, shared."""
    entry = PREFILL_DEFAULTS[("hip" if hip else "cuda", _head_dim_bucket(head_dim))]
    config = {k: v for k, v in entry.items() if k != "short_chunks"}
    if short:
        config.update(entry.get("short_chunks", {}))
    return config


def choose_kv_lookup(page_size: int, block_n: int) -> str:
    """The "tile" lookup when a tile never straddles pages (the page is a multiple of BLOCK_N), else
    "row" (one lookup per key row works for every page size)."""
    return "tile" if page_size % block_n == 0 else "row"


def choose_heads_per_program(group: int, block_m: int, max_seqlen_q: int) -> int:
    """Query heads of one KV group per program: enough that a short chunk fills the BLOCK_M
    rows (64 queries x 2 heads = 128), never more than the largest power of two dividing
    the group. Long chunks fill the rows with queries alone: 1."""
    pow2_divisor = group & -group
    rows_per_head = min(block_m, triton.next_power_of_2(max(1, max_seqlen_q)))
    return max(1, min(pow2_divisor, block_m // rows_per_head))


def choose_prefill_splits(
    programs: int, max_context: int, block_n: int, num_multiprocessors: int
) -> int:
    """Split-KV count for a prefill launch, from host-known shapes only: as many splits as
    keep the launch within one program per multiprocessor (a BLOCK_M-row program holds
    most of a multiprocessor's shared memory, and one per multiprocessor streams K/V at
    full rate), each covering at least _MIN_TOKENS_PER_SPLIT keys of the longest possible
    context (`block_tables.shape[1] * page_size`)."""
    wanted = num_multiprocessors // max(1, programs)
    useful = max_context // max(_MIN_TOKENS_PER_SPLIT, block_n)
    return max(1, min(wanted, useful, _MAX_SPLITS))


@functools.lru_cache(maxsize=64)
def _check_launch(
    block_m: int, block_n: int, heads_per_program: int, group: int, page_size: int, lookup: str
) -> None:
    if lookup not in _KV_LOOKUPS:
        raise ValueError(f"kv_lookup={lookup!r}: expected one of {sorted(_KV_LOOKUPS)} or auto")
    for name, v in (("block_m", block_m), ("block_n", block_n)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name}={v}: must be a power of two >= 16")
    hpp = heads_per_program
    if hpp < 1 or hpp & (hpp - 1) or group % hpp or block_m % hpp:
        raise ValueError(
            f"heads_per_program={hpp}: must be a power of two dividing the GQA group ({group}) "
            f"and block_m ({block_m})"
        )
    if lookup == "page" and block_n % page_size:
        raise ValueError(f"kv_lookup='page' needs block_n ({block_n}) to span whole pages "
                         f"({page_size})")  # fmt: skip
    if lookup == "tile" and page_size % block_n:
        raise ValueError(f"kv_lookup='tile' needs the page ({page_size}) to be a multiple of "
                         f"block_n ({block_n})")  # fmt: skip


@dataclass(frozen=True)
class PrefillLaunch:
    """Every setting of one prefill launch, as `plan_prefill_launch` resolved it."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    heads_per_program: int
    kv_lookup: str
    loop_stages: int
    warp_specialize: bool
    num_tiles: int  # query tiles per chunk (BLOCK_M // heads_per_program queries each)
    num_splits: int


def plan_prefill_launch(
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    batch: int,
    max_seqlen_q: int,
    max_context: int,
    num_multiprocessors: int,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    num_splits: int | None = None,
    heads_per_program: int | None = None,
    kv_lookup: str | None = None,
    loop_stages: int | None = None,
    warp_specialize: bool | None = None,
) -> PrefillLaunch:
    """The launch for these shapes: the defaults for head_dim and vendor (their short-chunk
    overrides when every chunk is at most SHORT_CHUNK_TOKENS), then each given override, then
    the automatic choices (heads per program, block-table lookup, splits). Host values only:
    no tensor is read, so the same shapes always give the same launch. Raises ValueError for
    settings the kernel cannot run."""
    return _plan(
        num_heads, num_kv_heads, head_dim, page_size, batch, max_seqlen_q, max_context,
        num_multiprocessors, block_m, block_n, num_warps, num_stages, num_splits,
        heads_per_program, kv_lookup, loop_stages, warp_specialize,
        torch.version.hip is not None,
    )  # fmt: skip


# Every layer of a step plans the same launch: cached, positional (the forward calls it once
# per attention layer, so it costs a dict lookup instead of ~5 us of Python).
@functools.lru_cache(maxsize=1024)
def _plan(
    num_heads, num_kv_heads, head_dim, page_size, batch, max_seqlen_q, max_context,
    num_multiprocessors, block_m, block_n, num_warps, num_stages, num_splits, heads_per_program,
    kv_lookup, loop_stages, warp_specialize, hip,
) -> PrefillLaunch:  # fmt: skip
    """`plan_prefill_launch`'s work, its arguments positional (and `hip`: the vendor)."""
    config = _defaults(head_dim, torch.version.hip is not None, max_seqlen_q <= SHORT_CHUNK_TOKENS)
    block_m = block_m or config["block_m"]
    block_n = block_n or config["block_n"]
    group = num_heads // num_kv_heads
    hpp = heads_per_program or config.get("heads_per_program")
    hpp = hpp or choose_heads_per_program(group, block_m, max_seqlen_q)
    lookup = kv_lookup or config.get("kv_lookup", "auto")
    if lookup == "auto":
        lookup = choose_kv_lookup(page_size, block_n)
    _check_launch(block_m, block_n, hpp, group, page_size, lookup)
    if warp_specialize is None:
        warp_specialize = config.get("warp_specialize", False)
    if warp_specialize and not HAS_WARP_SPECIALIZE:
        raise ValueError(f"warp_specialize needs Triton >= 3.4 (this is {triton.__version__})")
    num_tiles = triton.cdiv(max_seqlen_q, block_m // hpp)
    if num_splits is None:
        programs = (num_heads // hpp) * num_tiles * batch
        num_splits = choose_prefill_splits(programs, max_context, block_n, num_multiprocessors)
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits}: must be >= 1")
    return PrefillLaunch(
        block_m=block_m,
        block_n=block_n,
        num_warps=num_warps or config["num_warps"],
        num_stages=num_stages or config["num_stages"],
        heads_per_program=hpp,
        kv_lookup=lookup,
        loop_stages=config.get("loop_stages", 0) if loop_stages is None else loop_stages,
        warp_specialize=bool(warp_specialize),
        num_tiles=num_tiles,
        num_splits=num_splits,
    )


def paged_attention_prefill(
    q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, max_seqlen_q, out=None, *,
    k_scale=1.0, v_scale=1.0, sliding_window=0, sinks=None, block_m=None, block_n=None,
    num_warps=None, num_stages=None, num_splits=None, heads_per_program=None, kv_lookup=None,
    loop_stages=None, warp_specialize=None,
):  # fmt: skip
    """See `atom_kernels.ops.paged_attention_prefill`. The keyword-only arguments override
    the tuned launch settings and the automatic choices (tests use small tiles and forced
    splits on small shapes; the benchmark sweeps them)."""
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    out = paged_output(q, k_cache, v_cache, out)
    batch = seq_lens.shape[0]
    if batch == 0 or max_seqlen_q <= 0 or num_tokens == 0:
        return out

    max_context = block_tables.shape[1] * page_size
    if sliding_window > 0:  # a tile's keys: its queries' windows
        max_context = min(max_context, sliding_window + max_seqlen_q)
    plan = _plan(
        num_heads, num_kv_heads, head_dim, page_size, batch, max_seqlen_q,
        max_context, _multiprocessor_count(q.device), block_m, block_n,
        num_warps, num_stages, num_splits, heads_per_program, kv_lookup, loop_stages,
        warp_specialize, torch.version.hip is not None,
    )  # fmt: skip
    num_splits, hpp = plan.num_splits, plan.heads_per_program
    split = num_splits > 1
    if split:
        # fp32 max and sum [num_splits, T, num_heads] and acc [..., head_dim], carved out of
        # one allocation (each part 128-byte aligned: pointer alignment is part of a compiled
        # kernel's specialisation); every real (token, head) row of every split is written
        # by the split kernel.
        rows = num_splits * num_tokens * num_heads
        acc_len, row_len = -(-rows * head_dim // 32) * 32, -(-rows // 32) * 32
        parts = torch.empty(acc_len + 2 * row_len, dtype=torch.float32, device=q.device)
        part_acc = parts[:acc_len]
        part_max = parts[acc_len : acc_len + row_len]
        part_sum = parts[acc_len + row_len :]
    else:
        part_acc = part_max = part_sum = out  # unused by the unsplit path

    block_d = triton.next_power_of_2(head_dim)
    q_strides, out_strides, cache_strides = q.stride(), out.stride(), k_cache.stride()
    grid = (num_heads // hpp, plan.num_tiles * num_splits, batch)
    k_arg, k_ptr = scale_arg(k_scale)
    v_arg, v_ptr = scale_arg(v_scale)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, part_acc, part_max, part_sum, cu_seqlens_q, seq_lens,
        block_tables, out if sinks is None else sinks, scale * _LOG2E, num_splits, num_tokens,
        q_strides[0], q_strides[1], out_strides[0], out_strides[1], cache_strides[0],
        cache_strides[1], cache_strides[2], block_tables.stride(0), num_heads // num_kv_heads,
        k_arg, v_arg, HEADS_PER_PROG=hpp, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_D=block_d, SPLIT=split,
        KV_LOOKUP=_KV_LOOKUPS[plan.kv_lookup], LOOP_STAGES=plan.loop_stages,
        WARP_SPEC=plan.warp_specialize, IEEE_DOT=q.dtype == torch.float32, FP8=is_fp8(k_cache),
        K_SCALE_PTR=k_ptr, V_SCALE_PTR=v_ptr, WINDOW=sliding_window, HAS_SINKS=sinks is not None,
        num_warps=plan.num_warps, num_stages=plan.num_stages,
    )  # fmt: skip
    if split:
        _prefill_merge_kernel[(num_tokens, num_heads)](
            out, part_acc, part_max, part_sum, cu_seqlens_q, out if sinks is None else sinks, batch,
            num_splits, out_strides[0], out_strides[1], HEAD_DIM=head_dim,
            BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
            HAS_SINKS=sinks is not None, num_warps=1 if block_d <= 128 else 2,
        )  # fmt: skip
    return out


# -- compiling every variant before serving -------------------------------------------------------


def _variant(plan: PrefillLaunch) -> tuple:
    """What a launch compiles: its constexprs and launch settings (the split count only through
    the merge kernel's BLOCK_S)."""
    split = plan.num_splits > 1
    return (
        plan.block_m, plan.block_n, plan.num_warps, plan.num_stages, plan.heads_per_program,
        plan.kv_lookup, plan.loop_stages, plan.warp_specialize, split,
        triton.next_power_of_2(plan.num_splits) if split else 0,
    )  # fmt: skip


def reachable_launches(
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    max_num_seqs: int,
    max_tokens: int,
    max_context: int,
    num_multiprocessors: int,
) -> list[PrefillLaunch]:
    """One launch per distinct compiled variant that the automatic choices can pick for steps of
    at most `max_tokens` tokens in at most `max_num_seqs` sequences over contexts of at most
    `max_context` keys. The choices depend on the chunk length (short or long settings, heads
    per program), the batch and the context (the split count), so the variants are found by
    walking those over powers of two and every boundary between them. Host values only."""
    qs = {min(max_tokens, 1 << i) for i in range(max_tokens.bit_length() + 1)}
    qs |= {min(max_tokens, SHORT_CHUNK_TOKENS), min(max_tokens, SHORT_CHUNK_TOKENS + 1)}
    batches = {min(max_num_seqs, 1 << i) for i in range(max_num_seqs.bit_length() + 1)}
    contexts = {min(max_context, page_size << i) for i in range(max_context.bit_length() + 1)}
    plan = _plan.__wrapped__  # not through the serving path's cache
    hip = torch.version.hip is not None
    found: dict[tuple, PrefillLaunch] = {}
    for q in sorted(qs):
        for batch in sorted(batches):
            if q + batch - 1 > max_tokens:  # every other sequence brings a token at least
                continue
            for context in sorted(contexts):
                if context < q:
                    continue
                launch = plan(
                    num_heads, num_kv_heads, head_dim, page_size, batch, q, context,
                    num_multiprocessors, None, None, None, None, None, None, None, None, None, hip,
                )  # fmt: skip
                found.setdefault(_variant(launch), launch)
    return list(found.values())


def warm_up(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
    q_row_width: int,
    scale: float,
    launches: list[PrefillLaunch],
    *,
    q_dtype: torch.dtype | None = None,
    k_scale: torch.Tensor | float = 1.0,
    v_scale: torch.Tensor | float = 1.0,
    sliding_window: int = 0,
    sinks: torch.Tensor | None = None,
) -> list[tuple[PrefillLaunch, Exception]]:
    """Compile each launch in `launches` (from `reachable_launches`) by running it once on one
    token over one page of these caches (read only), q shaped like the model's (a view of a
    `q_row_width`-wide projection), so no step compiles a kernel while serving: a first
    compile costs about a second, inside some request's time to first token. Returns the
    launches that failed, with their errors (the others are compiled all the same).

    `q_dtype`: the model's activation dtype (default the cache's; an FP8 cache needs it given).
    `k_scale`, `v_scale`: as the serving steps pass them (a float and a tensor compile apart).
    A model's windowed layers and layers with sinks compile variants of their own: warm each
    kind (`sliding_window`, `sinks`)."""
    _, page_size, _, head_dim = k_cache.shape
    dev = k_cache.device
    if q_dtype is None:
        if is_fp8(k_cache):
            raise ValueError("an FP8 cache's warm-up needs q_dtype (the model's dtype)")
        q_dtype = k_cache.dtype
    qkv = torch.zeros(1, q_row_width, dtype=q_dtype, device=dev)
    q = qkv[:, : num_heads * head_dim].view(1, num_heads, head_dim)
    cu = torch.tensor([0, 1], dtype=torch.int32, device=dev)
    lens = torch.ones(1, dtype=torch.int32, device=dev)
    table = torch.zeros(1, 1, dtype=torch.int32, device=dev)
    failed = []
    for launch in launches:
        try:
            paged_attention_prefill(
                q, k_cache, v_cache, cu, lens, table, scale, 1,
                sliding_window=sliding_window, sinks=sinks, block_m=launch.block_m, block_n=launch.block_n, num_warps=launch.num_warps,
                num_stages=launch.num_stages, num_splits=launch.num_splits,
                heads_per_program=launch.heads_per_program, kv_lookup=launch.kv_lookup,
                loop_stages=launch.loop_stages, warp_specialize=launch.warp_specialize,
                k_scale=k_scale, v_scale=v_scale,
            )  # fmt: skip
        except Exception as exc:  # a variant this GPU or Triton cannot build
            failed.append((launch, exc))
    return failed

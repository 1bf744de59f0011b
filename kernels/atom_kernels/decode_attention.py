"""Triton paged attention for decode: one query token per sequence, split-K over the context.

Grid of the main kernel: (sequence, kv head, split). One program loads the GROUP query
heads that share a KV head as the rows of one tile, so each K/V row is read from memory
once for the whole group, and walks its split's token range BLOCK_N tokens at a time with
an online (running max / running sum) softmax. Tokens are gathered through the block
table one row at a time, so any page size works (not only powers of two) and a tile may
straddle pages.

Split-K: when batch * kv_heads programs would not fill the GPU, the context is cut into
NUM_SPLITS contiguous ranges processed by separate programs; each writes an unnormalised
partial output with its running max and sum, and a second kernel merges them
(log-sum-exp). The split count depends only on shapes (batch, kv heads,
max_blocks_per_seq) and the device, never on context_lens values, so a CUDA graph
captured once stays valid. Each sequence cuts its own context into that many ranges on the
device (a multiple of BLOCK_N tokens each), so a short context still spreads over several
programs instead of landing whole in the first split; splits past its end do no work.

Sliding window and sinks (GPT-OSS, Mistral): with WINDOW > 0 a sequence's range is its last
WINDOW positions, so the splits cut that range and no block before it is read (a windowed
layer's blocks there may already be back in the pool). A sink is a per-head logit that joins
the softmax's denominator at the end (single split) or in the merge.

Heads a program (HEADS, `decode_heads_per_program`): at large batch one program may attend for
two KV heads, reading each token's K/V for both as one contiguous run. Its query tile is then
block-diagonal (each query head's vector sits in its KV head's columns, zeros elsewhere), so
one dot still gives every row its own head's scores and P @ V its own head's output.

FP8 cache (float8_e4m3fn / e4m3fnuz, per-tensor k_scale and v_scale): K and V tiles are read as
FP8 (half the bytes) and converted to fp16 for the dots (q too); k_scale is folded into the softmax
scale (q.(s k) = s (q.k)) and v_scale multiplies the output once (sum p (s v) = s sum p v). A
cache of q's dtype compiles none of it.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from atom_kernels import envs, pdl
from atom_kernels.fp8_formats import is_fp8
from atom_kernels.fp8_quant import load_scale, scale_arg
from atom_kernels.pdl import wait_for_inputs

_LOG2E = 1.4426950408889634

# Fewest tokens a split should cover: below this the merge costs more than it saves.
_MIN_TOKENS_PER_SPLIT = 256
_MAX_SPLITS = 32
# Splits the merge kernel reads at a time.
_MERGE_SPLITS = 8
# `paged_attention_decode(heads_fastest=True)` runs a sequence's KV heads together in the grid.
# Off by default: on an H200 it moved W1 by +1% (29,242 -> 29,546 tok/s, one call), inside what
# varies from call to call, and W1's attention by -7% to +6% by context (kernels_bench.py
# --sweep w1bal; docs/perf-journal/2026-12-02.md). The sweep passes it explicitly.
# Two KV heads a program at large batch (`decode_heads_per_program`); ATOM_DECODE_PACK_HEADS=0
# keeps one (for A/B runs). Read once at import.
PACK_HEADS = envs.DECODE_PACK_HEADS.enabled()


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr, part_acc_ptr,
    part_max_ptr, part_sum_ptr, sinks_ptr, scale_log2, q_stride_b, q_stride_h, cache_stride_block,
    cache_stride_off, cache_stride_h, bt_stride_b, out_stride_b, out_stride_h, k_scale, v_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE_DOT: tl.constexpr,
    HEADS_FASTEST: tl.constexpr = False, PDL: tl.constexpr = False, HEADS: tl.constexpr = 1,
    FP8: tl.constexpr = False, K_SCALE_PTR: tl.constexpr = False, V_SCALE_PTR: tl.constexpr = False,
    WINDOW: tl.constexpr = 0, HAS_SINKS: tl.constexpr = False,
):  # fmt: skip
    wait_for_inputs(PDL)
    if HEADS_FASTEST:  # grid (kv head, sequence, split): a sequence's heads launch together
        kv_base = tl.program_id(0) * HEADS
        seq = tl.program_id(1)
        num_heads = tl.num_programs(0) * HEADS * GROUP
    else:
        seq = tl.program_id(0)
        kv_base = tl.program_id(1) * HEADS
        num_heads = tl.num_programs(1) * HEADS * GROUP
    split = tl.program_id(2)

    ctx = tl.load(context_lens_ptr + seq)
    lo = _window_start(ctx, WINDOW)
    tokens_per_split = tl.cdiv(tl.cdiv(ctx - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * tokens_per_split
    end = tl.minimum(ctx, start + tokens_per_split)

    # A split past this sequence's context writes nothing (the merge never reads it).
    if (start < ctx) | (NUM_SPLITS == 1):
        # Rows: the GROUP query heads of each of the program's HEADS KV heads. Columns: those
        # KV heads' dims side by side (HEADS x BLOCK_D), one contiguous run of the cache row.
        # The query tile is block-diagonal, so one dot gives each row its own head's scores
        # and P @ V its own head's output in its head's columns (the rest is never stored).
        offs_r = tl.arange(0, BLOCK_G)
        offs_n = tl.arange(0, BLOCK_N)
        offs_c = tl.arange(0, HEADS * BLOCK_D)
        col_head = offs_c // BLOCK_D
        col_dim = offs_c % BLOCK_D
        d_mask = col_dim < HEAD_DIM
        heads = kv_base * GROUP + offs_r
        r_mask = offs_r < HEADS * GROUP
        mine = r_mask[:, None] & ((offs_r // GROUP)[:, None] == col_head[None, :]) & d_mask[None, :]

        q_ptrs = (
            q_ptr + seq.to(tl.int64) * q_stride_b + heads[:, None] * q_stride_h + col_dim[None, :]
        )
        q = tl.load(q_ptrs, mask=mine, other=0.0)
        if FP8:
            scale_log2 = scale_log2 * load_scale(k_scale, K_SCALE_PTR)
            # The dots run in fp16: FP8 -> fp16 is one hardware conversion for two values on
            # Hopper and MI300, FP8 -> bf16 a longer sequence (the converted read ran at 1.1 TB/s
            # against bf16's 3.2 on an H200, W1's shape, 2026-12-03). q (RMS-normed) fits fp16;
            # an fp32 q keeps fp32 dots.
            if not IEEE_DOT:
                q = q.to(tl.float16)

        m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, HEADS * BLOCK_D], dtype=tl.float32)

        bt_row = block_tables_ptr + seq.to(tl.int64) * bt_stride_b
        col_off = (kv_base + col_head).to(tl.int64) * cache_stride_h + col_dim
        for tile in range(start, end, BLOCK_N):
            pos = tile + offs_n
            valid = pos < end
            block = tl.load(bt_row + pos // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
            rows = block * cache_stride_block + (pos % PAGE_SIZE) * cache_stride_off
            kv_ptrs = rows[:, None] + col_off[None, :]
            if BLOCK_D == HEAD_DIM:  # a mask constant along the columns keeps loads vectorised
                kv_mask = valid[:, None]
            else:
                kv_mask = valid[:, None] & d_mask[None, :]
            k = tl.load(k_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0).to(q.dtype)
            if IEEE_DOT:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            # Every tile holds at least one valid token, so m_new is finite.
            s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0).to(q.dtype)
            if IEEE_DOT:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        if FP8:  # partial sums too: the merge is linear in them
            acc = acc * load_scale(v_scale, V_SCALE_PTR)

        if NUM_SPLITS == 1:
            if HAS_SINKS:
                sink = tl.load(sinks_ptr + heads, mask=r_mask, other=0.0).to(tl.float32)
                acc, l_i = _add_sink(acc, m_i, l_i, sink * 1.4426950408889634)
            # context_len 0: no tile ran, l_i is 0, and the row is written as zeros.
            denom = tl.where(l_i > 0, l_i, 1.0)
            o = acc / denom[:, None]
            o_ptrs = (
                out_ptr
                + seq.to(tl.int64) * out_stride_b
                + heads[:, None] * out_stride_h
                + col_dim[None, :]
            )
            tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=mine)
        else:
            # Partial buffers are [B, num_heads, NUM_SPLITS(, HEAD_DIM)], contiguous.
            row = (seq.to(tl.int64) * num_heads + heads) * NUM_SPLITS + split
            tl.store(part_max_ptr + row, m_i, mask=r_mask)
            tl.store(part_sum_ptr + row, l_i, mask=r_mask)
            acc_ptrs = part_acc_ptr + row[:, None] * HEAD_DIM + col_dim[None, :]
            tl.store(acc_ptrs, acc, mask=mine)


@triton.jit
def _window_start(ctx, WINDOW: tl.constexpr):
    """The first position the token at ctx - 1 sees: 0, or its window's first."""
    if WINDOW > 0:
        return tl.maximum(ctx - WINDOW, 0)
    return ctx * 0


@triton.jit
def _add_sink(acc, m, total, sink_log2):
    """Rows' (acc, sum) with a sink logit (log2 domain, [rows]) joined to the softmax: rescaled
    to max(m, sink), the sink's term added to the sum only."""
    m_new = tl.maximum(m, sink_log2)
    keep = tl.exp2(m - m_new)  # 0 for a row with no key (m = -inf)
    return acc * keep[:, None], total * keep + tl.exp2(sink_log2 - m_new)


@triton.jit
def _decode_merge_kernel(
    context_lens_ptr, out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, sinks_ptr, out_stride_b,
    out_stride_h, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr = False,
    WINDOW: tl.constexpr = 0, HAS_SINKS: tl.constexpr = False,
):  # fmt: skip
    wait_for_inputs(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    ctx = tl.load(context_lens_ptr + seq)
    span = ctx - _window_start(ctx, WINDOW)
    tokens_per_split = tl.cdiv(tl.cdiv(span, NUM_SPLITS), BLOCK_N) * BLOCK_N
    live_splits = tl.cdiv(span, tl.maximum(tokens_per_split, 1))

    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    base = (seq.to(tl.int64) * num_heads + head) * NUM_SPLITS
    # BLOCK_S splits at a time over the live ones only (a short context in a graph captured for
    # long ones has a few live splits of many), folded into a running max, sum and output.
    m_run = tl.max(tl.full([BLOCK_S], float("-inf"), dtype=tl.float32), axis=0)
    total = tl.sum(tl.zeros([BLOCK_S], dtype=tl.float32), axis=0)
    o = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s0 in range(0, live_splits, BLOCK_S):
        s_mask = s0 + offs_s < live_splits
        row = base + s0 + offs_s
        m = tl.load(part_max_ptr + row, mask=s_mask, other=float("-inf"))
        l_part = tl.load(part_sum_ptr + row, mask=s_mask, other=0.0)
        acc_ptrs = part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :]
        acc = tl.load(acc_ptrs, mask=s_mask[:, None] & d_mask[None, :], other=0.0)
        m_new = tl.maximum(m_run, tl.max(m, axis=0))  # finite: split s0 is live
        keep = tl.exp2(m_run - m_new)  # 0 on the first pass (m_run -inf)
        w = tl.exp2(m - m_new)
        total = total * keep + tl.sum(l_part * w, axis=0)
        o = o * keep + tl.sum(acc * w[:, None], axis=0)
        m_run = m_new
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        m_fin = tl.maximum(m_run, sink)
        keep = tl.exp2(m_run - m_fin)
        o = o * keep
        total = total * keep + tl.exp2(sink - m_fin)
    o = o / tl.where(total > 0, total, 1.0)  # no live split (context_len 0): zeros
    o_ptrs = out_ptr + seq.to(tl.int64) * out_stride_b + head * out_stride_h + offs_d
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=d_mask)


@functools.lru_cache(maxsize=8)
def _multiprocessor_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # CPU under TRITON_INTERPRET: any small number; tests pick splits themselves


def choose_num_splits(
    batch: int, num_kv_heads: int, max_context: int, block_n: int, num_multiprocessors: int
) -> int:
    """Split count for a decode launch, from shapes and the device's size only.

    Aim for about two programs per multiprocessor in total (on an H200, batch 64 x 8 KV
    heads already reads 4k-token contexts at ~88% of copy bandwidth unsplit, and 2-8
    splits measured slower), but give each split at least _MIN_TOKENS_PER_SPLIT tokens of
    the longest possible context.
    """
    programs = max(1, batch * num_kv_heads)
    wanted = math.ceil(2 * num_multiprocessors / programs)
    useful = max(1, max_context // max(_MIN_TOKENS_PER_SPLIT, block_n))
    return max(1, min(wanted, useful, _MAX_SPLITS))


def decode_heads_per_program(
    batch: int, num_kv_heads: int, group: int, head_dim: int, num_splits: int,
    num_multiprocessors: int,
) -> int:  # fmt: skip
    """KV heads one program attends for (1 or 2), from shapes and the device only.

    Two when an unsplit launch would still have at least 4 programs per multiprocessor with
    them: each program then reads 512 contiguous bytes of a token's K/V row instead of 256,
    and there are half as many program starts. W1's step on an H200 (batch 256, Qwen3-0.6B
    heads, a standalone version of this kernel; `kernels_bench.py --sweep w1pack`): 2.78 -> 3.22 TB/s over prompts of 100-1,024 tokens,
    3.35 -> 3.40 and 3.51 -> 3.59 with 256 and 511 generated; four or eight heads a program
    lost (2.3 and 1.3-1.4 TB/s: larger tiles, fewer resident programs). Needs both query
    groups in the 16 rows of the dot and head_dim <= 128 (the accumulator's width doubles).
    """
    if not PACK_HEADS or num_splits != 1 or num_kv_heads % 2 or 2 * group > 16:
        return 1
    if triton.next_power_of_2(head_dim) > 128:
        return 1
    return 2 if batch * num_kv_heads // 2 >= 4 * num_multiprocessors else 1


def decode_config(head_dim: int) -> dict[str, int]:
    """Launch settings by head_dim: BLOCK_N tokens per step, sized so a K and a V tile fit
    in registers beside the fp32 accumulator.

    head_dim 128 on an H200 (bf16, batch 64 x 4k context, unsplit): BLOCK_N 64 with 4
    warps and 3 stages read ~3.7 TB/s (~88% of the copy ceiling); 2 stages ~3.4, BLOCK_N
    32 or 128 ~3.2-3.3. ROCm gets 2 stages (its stream pipeliner's sweet spot).
    """
    block_d = triton.next_power_of_2(head_dim)
    stages = 2 if torch.version.hip is not None else 3
    if block_d <= 128:
        return {"block_n": 64, "num_warps": 4, "num_stages": stages}
    return {"block_n": 32, "num_warps": 8, "num_stages": 2}


def paged_output(q, k_cache, v_cache, out):
    """The output of a paged attention over q `[T, H, D]` (`out` checked, or a new one); the
    layouts the kernels need checked: a contiguous head_dim, the caches' strides equal."""
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("q and the caches need a contiguous head_dim; caches share strides")
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.stride(2) != 1:
        raise ValueError(f"out {tuple(out.shape)} must match q {tuple(q.shape)}")
    return out


def paged_attention_decode(
    q, k_cache, v_cache, block_tables, context_lens, scale, out=None, *, k_scale=1.0, v_scale=1.0,
    sliding_window=0, sinks=None, num_splits=None, block_n=None, num_warps=None, num_stages=None,
    heads_fastest=None, heads_per_program=None,
):  # fmt: skip
    """See `atom_kernels.ops.paged_attention_decode`. The keyword-only arguments override
    the automatic choices (tests use them to engage split-K on small shapes; the benchmark
    sweeps them). `heads_fastest` orders the grid (kv head, sequence, split) instead of
    (sequence, kv head, split), so the programs of one sequence's KV heads run at the same time
    and read the same pages together (a token's K row of every head is one contiguous
    `num_kv_heads * head_dim` run in the vLLM cache layout); default off.
    `heads_per_program`: KV heads a program attends for (a divisor of `num_kv_heads` whose
    query heads fit 16 rows; default `decode_heads_per_program`)."""
    batch, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    out = paged_output(q, k_cache, v_cache, out)
    if batch == 0:
        return out

    config = decode_config(head_dim)
    block_n = block_n or config["block_n"]
    max_context = block_tables.shape[1] * page_size
    if sliding_window > 0:
        max_context = min(max_context, sliding_window)
    if num_splits is None:
        num_splits = choose_num_splits(
            batch, num_kv_heads, max_context, block_n, _multiprocessor_count(q.device)
        )

    # An FP8 cache keeps one KV head a program: at W1's shape on an H200 two ran at 0.91x of
    # bf16's speed against 1.03x for one (`kernels_bench.py --sweep fp8`, 2026-12-03).
    heads = heads_per_program or (
        1
        if is_fp8(k_cache)
        else decode_heads_per_program(
            batch, num_kv_heads, group, head_dim, num_splits, _multiprocessor_count(q.device)
        )
    )
    if num_kv_heads % heads or heads * group > 16:
        raise ValueError(
            f"heads_per_program {heads}: must divide {num_kv_heads} KV heads and fit its "
            f"{heads * group} query heads in 16 rows"
        )
    if heads > 1 and num_stages is None:
        num_stages = 2  # the doubled tiles: 2 stages measured best (64 tokens, 4 warps)

    if num_splits > 1:
        part_acc = torch.empty(
            (batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
        part_max = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # unused by the single-split path

    block_d = triton.next_power_of_2(head_dim)
    heads_fastest = bool(heads_fastest)
    programs = num_kv_heads // heads
    k_arg, k_ptr = scale_arg(k_scale)
    v_arg, v_ptr = scale_arg(v_scale)
    grid = (programs, batch, num_splits) if heads_fastest else (batch, programs, num_splits)
    _decode_split_kernel[grid](
        q, k_cache, v_cache, block_tables, context_lens, out, part_acc, part_max, part_sum,
        out if sinks is None else sinks, scale * _LOG2E, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), k_arg, v_arg, GROUP=group, HEAD_DIM=head_dim,
        PAGE_SIZE=page_size, NUM_SPLITS=num_splits,
        BLOCK_G=max(16, triton.next_power_of_2(heads * group)), BLOCK_N=block_n, BLOCK_D=block_d,
        IEEE_DOT=q.dtype == torch.float32, HEADS_FASTEST=heads_fastest, HEADS=heads,
        FP8=is_fp8(k_cache), K_SCALE_PTR=k_ptr, V_SCALE_PTR=v_ptr, WINDOW=sliding_window,
        HAS_SINKS=sinks is not None, num_warps=num_warps or config["num_warps"],
        num_stages=num_stages or config["num_stages"], **pdl.options(q.device),
    )  # fmt: skip
    if num_splits > 1:
        _decode_merge_kernel[(batch, num_heads)](
            context_lens, out, part_acc, part_max, part_sum, out if sinks is None else sinks,
            out.stride(0), out.stride(1), HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
            BLOCK_S=min(_MERGE_SPLITS, triton.next_power_of_2(num_splits)), BLOCK_D=block_d,
            BLOCK_N=block_n, WINDOW=sliding_window, HAS_SINKS=sinks is not None,
            num_warps=1 if block_d <= 128 else 2, **pdl.options(q.device),
        )  # fmt: skip
    return out

"""Triton matrix-vector product for decode at batch 1: y = x @ W.T (+ bias) with x [1, K].

At one row the projection is a pure weight read, so the kernel is built for bandwidth: each
program owns BLOCK_N output features and streams their [BLOCK_N, K] weight rows once,
BLOCK_K columns at a time, multiplying by the matching slice of x and keeping a
[BLOCK_N, BLOCK_K] fp32 accumulator that is reduced across K only once at the end. When
N / BLOCK_N programs would leave multiprocessors idle (narrow outputs such as the down
projection), K is split as well: each split writes an fp32 partial row, and the last split of
each column block to finish sums them and rounds to the output dtype (`atom_kernels.tickets`;
`merge="kernel"` uses a second tiny kernel instead, as does a launch whose counters could not
be set up during CUDA-graph capture).

`act="silu_mul"` applies SwiGLU to the output of the gate_up projection: W is [gate; up]
(2I rows) and the result is silu(gate) * up, [1, I]. Each program streams the I-th-apart row
pairs for its BLOCK_N // 2 outputs, interleaved (gate, up, gate, ...) in one [BLOCK_N, BLOCK_K]
tile so the loop is the plain product's (two tiles with two accumulators ran qkv with rotary
40% slower), rounds both sums to the output dtype (as the separate GEMV output would be) and
applies the activation in fp32 once per output, so the activation needs no launch of its own
and the [1, 2I] row is never written.

`rope=RopeStore(...)` finishes a one-token qkv projection as `qk_norm_rope_store_` would:
outputs are the dimension pairs (i, i + D/2) of every head, each program streams both rows of
its pairs, and the epilogue rotates q and k heads (cos/sin of the token's position; both paired
epilogues share the interleaved tile), returns the whole qkv row and stores k and v into the
paged cache slot. With QK-norm (Qwen3: `RopeStore.q_norm_weight` / `k_norm_weight`) every
program owns one whole head (its D rows), so the epilogue has the head's sum of squares at hand
and norms q and k before rotating them; K is split to keep enough programs streaming, and the
last split of a head to arrive finishes it.

`norm_weight=` fuses the RMSNorm that precedes a projection (with the residual add when
`residual=` is given): every program first loads the whole row at once and sums its squares
(x + residual, rounded to the row's dtype, as `fused_add_rms_norm` does), then multiplies W by
the normed row, rounded to the dtype before use. The first program writes x + residual out (a
new tensor: the others still read the old residual). One launch replaces the norm's own, but
every program pays for the whole row.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from atom_kernels import envs, norm, pdl
from atom_kernels.decode_attention import _multiprocessor_count as _multiprocessors
from atom_kernels.fp8_formats import is_fp8, scale_layout
from atom_kernels.fp8_quant import load_scale, scale_arg, store_kv_fp8
from atom_kernels.pdl import wait_for_inputs
from atom_kernels.tickets import ticket_counters

# Longest row the fused RMSNorm takes: it loads the whole row at once (16K elements is 64
# fp32 registers a thread at 8 warps).
MAX_NORM_ROW = 16384


# What the GEMV does with its output (MODE): write it; SwiGLU over [gate; up] rows; rotary of
# q and k heads with k and v stored into the paged cache; or that with QK-norm before rotary.
PLAIN, SWIGLU, ROPE, NORM_ROPE = 0, 1, 2, 3


class RopeStore(NamedTuple):
    """What `gemv(..., rope=)` needs to finish a one-token qkv projection like
    `ops.qk_norm_rope_store_`: the token's position and cache slot (device tensors of one
    element), the cos/sin table, the paged caches, the head layout, and QK-norm's weights and
    epsilon when the model has it."""

    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int
    q_norm_weight: torch.Tensor | None = None
    k_norm_weight: torch.Tensor | None = None
    qk_norm_eps: float = 1e-6
    # An FP8 cache's per-tensor scales (a float, or a one-element fp32 tensor); unused otherwise.
    k_scale: torch.Tensor | float = 1.0
    v_scale: torch.Tensor | float = 1.0


class Fp8Weight(NamedTuple):
    """How the kernel reads an FP8 weight's scale: W_SCALE 1 (one per output row; per tensor
    with stride 0) or 2 (blocks of SCALE_BN x SCALE_BK), the scale tensor and its row stride."""

    mode: int
    scale: torch.Tensor
    stride: int
    block_n: int = 128
    block_k: int = 128


def fp8_weight(
    weight: torch.Tensor,
    weight_scale: torch.Tensor | None,
    weight_block_size: tuple[int, int] | list[int] | None,
) -> Fp8Weight | None:
    """The kernel's view of an FP8 weight's scale (None for a half-precision weight)."""
    if not is_fp8(weight):
        return None
    layout = scale_layout(weight.shape, weight_scale, weight_block_size)
    if layout == "block":
        return Fp8Weight(2, weight_scale, weight_scale.stride(0), *weight_block_size)
    flat = weight_scale.reshape(-1)
    return Fp8Weight(1, flat, 0 if layout == "tensor" else flat.stride(0))


def check_block_scaled_launch(
    fp8: Fp8Weight, mode: int, block_n: int, block_k: int, n_out: int, half: int
) -> bool:
    """Raise unless every run of weight rows a program streams lies in one block of scale rows
    and a loop step in one block of scale columns (what the kernel's one scale a run and a step
    assumes); returns SAME_BLOCK, whether a pair's two rows share their block everywhere."""
    pairs = block_n // 2
    if fp8.block_k % block_k:
        raise ValueError(f"block_k={block_k} must divide the scale block's {fp8.block_k} columns")
    if mode == PLAIN and fp8.block_n % block_n:
        raise ValueError(f"block_n={block_n} must divide the scale block's {fp8.block_n} rows")
    if mode != PLAIN and (fp8.block_n % pairs or (n_out if mode == SWIGLU else half) % pairs):
        raise ValueError(
            f"block_n={block_n}: its {pairs} pairs must divide the scale block's {fp8.block_n} "
            f"rows and {'the gate rows' if mode == SWIGLU else 'half a head'}"
        )
    return mode in (ROPE, NORM_ROPE) and fp8.block_n % (2 * half) == 0


@triton.jit
def _swiglu(gate, up, dtype: tl.constexpr):
    """silu(gate) * up from fp32 sums rounded to `dtype` first, as `silu_and_mul` over the
    GEMV's own output would compute it."""
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def _paired_rows(offs, n_out, MODE: tl.constexpr, HALF: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The weight rows behind outputs `offs`: (first, second). SWIGLU pairs gate row j with up
    row n_out + j; ROPE pairs dimension i of a head with i + HALF (rotate-halves rotary), so
    output j is pair j: head j // HALF, dimension j % HALF (NORM_ROPE likewise). PLAIN uses
    `first` only."""
    if MODE >= 2:
        first = (offs // HALF) * HEAD_DIM + offs % HALF
        second = first + HALF
    else:
        first = offs
        second = offs + n_out
    return first, second


@triton.jit
def _epilogue(
    y, y2, offs, mask, first, second, bias_ptr, out_ptr, pos_ptr, cos_sin_ptr, k_cache_ptr,
    v_cache_ptr, slot_ptr, qn_ptr, kn_ptr, qk_eps, cos_sin_stride, cache_stride_slot, num_heads,
    num_kv_heads, ks, vs, HAS_BIAS: tl.constexpr, MODE: tl.constexpr, HALF: tl.constexpr,
    HEAD_DIM: tl.constexpr, KV_FP8: tl.constexpr,
):  # fmt: skip
    """Bias, then the MODE's finish and stores, from the fp32 sums of rows first (y) and
    second (y2). Every value is rounded to the output dtype where the unfused path would
    hold it in memory. NORM_ROPE needs `offs` to be one whole head's pairs. KV_FP8: the
    cache is FP8, k and v quantized with the scales ks, vs (fp32 scalars) as they are stored."""
    dtype = out_ptr.dtype.element_ty
    if HAS_BIAS:
        y += tl.load(bias_ptr + first, mask=mask, other=0.0).to(tl.float32)
        if MODE != 0:
            y2 += tl.load(bias_ptr + second, mask=mask, other=0.0).to(tl.float32)
    if MODE == 0:
        tl.store(out_ptr + offs, y.to(dtype), mask=mask)
    elif MODE == 1:
        tl.store(out_ptr + offs, _swiglu(y, y2, dtype).to(dtype), mask=mask)
    else:
        x1 = y.to(dtype).to(tl.float32)
        x2 = y2.to(dtype).to(tl.float32)
        head = offs // HALF
        dim = offs % HALF
        if MODE == 3:
            # QK-norm over the head (`offs` is all of it), rounded as the norm kernel's output.
            ss = tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)
            inv = 1.0 / tl.sqrt(ss / HEAD_DIM + qk_eps)
            is_q = head < num_heads
            w1 = tl.where(is_q, tl.load(qn_ptr + dim), tl.load(kn_ptr + dim)).to(tl.float32)
            w2 = tl.where(is_q, tl.load(qn_ptr + HALF + dim), tl.load(kn_ptr + HALF + dim))
            normed = head < num_heads + num_kv_heads  # v heads are not normed
            x1 = tl.where(normed, (x1 * inv * w1).to(dtype).to(tl.float32), x1)
            x2 = tl.where(normed, (x2 * inv * w2.to(tl.float32)).to(dtype).to(tl.float32), x2)
        table = cos_sin_ptr + tl.load(pos_ptr).to(tl.int64) * cos_sin_stride + dim
        cos = tl.load(table, mask=mask, other=0.0).to(tl.float32)
        sin = tl.load(table + HALF, mask=mask, other=0.0).to(tl.float32)
        rotate = head < num_heads + num_kv_heads  # q and k heads; v heads pass through
        o1 = tl.where(rotate, x1 * cos - x2 * sin, x1).to(dtype)
        o2 = tl.where(rotate, x2 * cos + x1 * sin, x2).to(dtype)
        tl.store(out_ptr + first, o1, mask=mask)
        tl.store(out_ptr + second, o2, mask=mask)
        # k heads (0 .. KV-1 past the q heads) and v heads (KV .. 2KV-1) into the cache slot;
        # slot -1 is a padding row.
        slot = tl.zeros_like(offs).to(tl.int64) + tl.load(slot_ptr).to(tl.int64)
        kv = head - num_heads
        live = mask & (kv >= 0) & (slot >= 0)
        is_k = live & (kv < num_kv_heads)
        is_v = live & (kv >= num_kv_heads)
        kv = tl.where(is_v, kv - num_kv_heads, kv)
        at = slot * cache_stride_slot + kv.to(tl.int64) * HEAD_DIM + dim
        store_kv_fp8(k_cache_ptr + at, o1, is_k, ks, KV_FP8)
        store_kv_fp8(k_cache_ptr + at + HALF, o2, is_k, ks, KV_FP8)
        store_kv_fp8(v_cache_ptr + at, o1, is_v, vs, KV_FP8)
        store_kv_fp8(v_cache_ptr + at + HALF, o2, is_v, vs, KV_FP8)


@triton.jit
def _finish_block(
    y, pid_n, n_out, bias_ptr, out_ptr, pos_ptr, cos_sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    qn_ptr, kn_ptr, qk_eps, cos_sin_stride, cache_stride_slot, num_heads, num_kv_heads, ks, vs,
    HAS_BIAS: tl.constexpr, MODE: tl.constexpr, BLOCK_N: tl.constexpr, HALF: tl.constexpr,
    HEAD_DIM: tl.constexpr, KV_FP8: tl.constexpr,
):  # fmt: skip
    """The epilogue of one program's block from its rows' fp32 sums `y` (a paired MODE's rows
    interleaved first, second, ...)."""
    if MODE == 0:
        offs = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        y2 = y
    else:
        offs = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        y, y2 = tl.split(tl.reshape(y, [BLOCK_N // 2, 2]))
    first, second = _paired_rows(offs, n_out, MODE, HALF, HEAD_DIM)
    _epilogue(
        y, y2, offs, offs < n_out, first, second, bias_ptr, out_ptr, pos_ptr, cos_sin_ptr,
        k_cache_ptr, v_cache_ptr, slot_ptr, qn_ptr, kn_ptr, qk_eps, cos_sin_stride,
        cache_stride_slot, num_heads, num_kv_heads, ks, vs, HAS_BIAS, MODE, HALF, HEAD_DIM, KV_FP8,
    )  # fmt: skip


@triton.jit
def _block_scaled_x(
    x, s_first, s_second, col_block, mask, even, MODE: tl.constexpr, SAME_BLOCK: tl.constexpr,
):  # fmt: skip
    """x times the weight's block scale, as the tile's rows see it: `[1, BLOCK_K]` when every row
    shares one scale row (the plain product; pairs in one block), else `[BLOCK_N, BLOCK_K]` with
    the first rows' scale on even lanes and the second rows' on odd ones. s_first / s_second
    point at those scale rows; `col_block` is a scalar (a loop step inside one column block) or
    one block index per column (the early columns, `mask` over them; None for a step)."""
    if mask is None:
        xa = x * tl.load(s_first + col_block)
    else:
        xa = x * tl.load(s_first + col_block, mask=mask, other=0.0)
    if MODE == 0 or SAME_BLOCK:
        return xa[None, :]
    else:
        if mask is None:
            xb = x * tl.load(s_second + col_block)
        else:
            xb = x * tl.load(s_second + col_block, mask=mask, other=0.0)
        return tl.where(even[:, None], xa[None, :], xb[None, :])


@triton.jit
def _gemv_input(
    x_ptr, residual_ptr, norm_w_ptr, ks, k_mask, inv_rms, dtype: tl.constexpr, NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):  # fmt: skip
    """x[ks] in fp32, normed (x + residual, rounded to the dtype, times inv_rms and the norm
    weight, rounded again) when the RMSNorm is fused in front."""
    if NORM:
        v = tl.load(x_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(residual_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
            v = (v + r).to(dtype).to(tl.float32)
        g = tl.load(norm_w_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
        return (v * inv_rms * g).to(dtype).to(tl.float32)
    else:
        return tl.load(x_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    residual_ptr,
    norm_w_ptr,
    residual_out_ptr,
    part_ptr,
    tickets_ptr,
    pos_ptr,
    cos_sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    qn_ptr,
    kn_ptr,
    w_scale_ptr,
    N,
    K,
    w_stride,
    w_scale_stride,
    k_per_split,
    eps,
    qk_eps,
    cos_sin_stride,
    cache_stride_slot,
    num_heads,
    num_kv_heads,
    k_scale,
    v_scale,
    HAS_BIAS: tl.constexpr,
    MODE: tl.constexpr,
    NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    SPLIT: tl.constexpr,
    TICKETS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    HALF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PDL: tl.constexpr = False,
    EARLY: tl.constexpr = 128,
    W_SCALE: tl.constexpr = 0,
    SCALE_BN: tl.constexpr = 128,
    SCALE_BK: tl.constexpr = 128,
    SAME_BLOCK: tl.constexpr = True,
    KV_FP8: tl.constexpr = False,
    K_SCALE_PTR: tl.constexpr = False,
    V_SCALE_PTR: tl.constexpr = False,
):
    # N counts the weight's rows. A program multiplies BLOCK_N rows; a paired MODE has N // 2
    # outputs, each from two rows, and its programs take BLOCK_N // 2 outputs with their rows
    # interleaved (first, second, first, ...) in one tile, so the loop streams one tile a step
    # as the plain product does.
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    lane = tl.arange(0, BLOCK_N)
    if MODE == 0:
        n_out = N
        row_n = pid_n * BLOCK_N + lane
        row_mask = row_n < N
    else:
        n_out = N // 2
        pair = pid_n * (BLOCK_N // 2) + lane // 2
        first_r, second_r = _paired_rows(pair, n_out, MODE, HALF, HEAD_DIM)
        row_n = tl.where(lane % 2 == 0, first_r, second_r)
        row_mask = pair < n_out
    rows = w_ptr + row_n.to(tl.int64)[:, None] * w_stride
    # FP8 weights in blocks (W_SCALE 2): each run of rows a program streams (all of them; or
    # the first and the second rows of its pairs) lies inside one block of SCALE_BN rows
    # (`_fp8_weight` checks the launch), so a step's scale is one number per run, applied to x.
    even = lane % 2 == 0
    s_first = w_scale_ptr
    s_second = w_scale_ptr
    if W_SCALE == 2:
        if MODE == 0:
            s_first = w_scale_ptr + (pid_n * BLOCK_N // SCALE_BN) * w_scale_stride
        else:
            f0, s0 = _paired_rows(pid_n * (BLOCK_N // 2), n_out, MODE, HALF, HEAD_DIM)
            s_first = w_scale_ptr + (f0 // SCALE_BN) * w_scale_stride
            s_second = w_scale_ptr + (s0 // SCALE_BN) * w_scale_stride
    offs_k = tl.arange(0, BLOCK_K)
    k_start = split * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    # The weights do not depend on the kernel before: the first EARLY columns (a multiple of
    # BLOCK_K) are requested before the wait (programmatic dependent launch), so they stream
    # while that kernel finishes.
    # (Names differ from the loop's below: the loop's tiles are BLOCK_K wide.)
    early_ks = k_start + tl.arange(0, EARLY)
    early_mask = early_ks < k_end
    early_w = tl.load(
        rows + early_ks[None, :], mask=row_mask[:, None] & early_mask[None, :], other=0.0
    )
    wait_for_inputs(PDL)
    dtype = x_ptr.dtype.element_ty
    inv_rms = 0.0
    if NORM:
        # The whole row in one load (one memory round trip, not one per BLOCK_K step); the
        # first program writes x + residual out.
        # (Names differ from the loop's below: Triton would carry them into the loop.)
        first_program = (pid_n == 0) & (split == 0)
        row_ks = tl.arange(0, ROW_BLOCK)
        row = tl.load(x_ptr + row_ks, mask=row_ks < K, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            row_r = tl.load(residual_ptr + row_ks, mask=row_ks < K, other=0.0).to(tl.float32)
            row = (row + row_r).to(dtype)
            tl.store(residual_out_ptr + row_ks, row, mask=row_ks < tl.where(first_program, K, 0))
            row = row.to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(row * row, axis=0) / K + eps)
    early_x = _gemv_input(
        x_ptr, residual_ptr, norm_w_ptr, early_ks, early_mask, inv_rms, dtype, NORM, HAS_RESIDUAL
    )
    if W_SCALE == 2:  # the early columns span several blocks: one scale per column
        early_xs = _block_scaled_x(
            early_x, s_first, s_second, early_ks // SCALE_BK, early_mask, even, MODE, SAME_BLOCK
        )
        head = tl.sum(early_w.to(tl.float32) * early_xs, axis=1)
    else:
        head = tl.sum(early_w.to(tl.float32) * early_x[None, :], axis=1)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(k_start + EARLY, k_end, BLOCK_K):
        ks = k0 + offs_k
        k_mask = ks < k_end
        x = _gemv_input(
            x_ptr, residual_ptr, norm_w_ptr, ks, k_mask, inv_rms, dtype, NORM, HAS_RESIDUAL
        )
        w = tl.load(rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        if W_SCALE == 2:  # the step lies in one column block (SCALE_BK % BLOCK_K == 0)
            xs = _block_scaled_x(x, s_first, s_second, k0 // SCALE_BK, None, even, MODE, SAME_BLOCK)
            acc += w.to(tl.float32) * xs
        else:
            acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1) + head
    if W_SCALE == 1:  # FP8 per output row (per tensor: stride 0)
        y = y * tl.load(w_scale_ptr + row_n * w_scale_stride, mask=row_mask, other=0.0)
    kv_ks = 1.0
    kv_vs = 1.0
    if KV_FP8:
        kv_ks = load_scale(k_scale, K_SCALE_PTR)
        kv_vs = load_scale(v_scale, V_SCALE_PTR)
    if SPLIT == 1:
        _finish_block(
            y, pid_n, n_out, bias_ptr, out_ptr, pos_ptr, cos_sin_ptr, k_cache_ptr, v_cache_ptr,
            slot_ptr, qn_ptr, kn_ptr, qk_eps, cos_sin_stride, cache_stride_slot, num_heads,
            num_kv_heads, kv_ks, kv_vs, HAS_BIAS, MODE, BLOCK_N, HALF, HEAD_DIM, KV_FP8,
        )  # fmt: skip
    else:
        # Partial sums are [SPLIT, N] fp32, indexed by weight row.
        tl.store(part_ptr + split * N + row_n, y, mask=row_mask)
        if TICKETS:
            # The last split of this block to arrive sums all of them (in split order, so the
            # result does not depend on which one that is) and resets the counter.
            tl.debug_barrier()
            ticket = tl.atomic_add(tickets_ptr + pid_n, 1, sem="acq_rel")
            if ticket == SPLIT - 1:
                total = tl.zeros([BLOCK_N], dtype=tl.float32)
                for s in tl.static_range(SPLIT):
                    part = part_ptr + s * N + row_n
                    total += tl.load(part, mask=row_mask, other=0.0, cache_modifier=".cg")
                _finish_block(
                    total, pid_n, n_out, bias_ptr, out_ptr, pos_ptr, cos_sin_ptr, k_cache_ptr,
                    v_cache_ptr, slot_ptr, qn_ptr, kn_ptr, qk_eps, cos_sin_stride,
                    cache_stride_slot, num_heads, num_kv_heads, kv_ks, kv_vs, HAS_BIAS, MODE,
                    BLOCK_N, HALF, HEAD_DIM, KV_FP8,
                )  # fmt: skip
                tl.store(tickets_ptr + pid_n, 0)


@triton.jit
def _gemv_reduce_kernel(
    part_ptr, bias_ptr, out_ptr, pos_ptr, cos_sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, qn_ptr,
    kn_ptr, N, qk_eps, cos_sin_stride, cache_stride_slot, num_heads, num_kv_heads, k_scale, v_scale,
    HAS_BIAS: tl.constexpr, MODE: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
    HALF: tl.constexpr, HEAD_DIM: tl.constexpr, PDL: tl.constexpr = False,
    KV_FP8: tl.constexpr = False, K_SCALE_PTR: tl.constexpr = False,
    V_SCALE_PTR: tl.constexpr = False,
):  # fmt: skip
    wait_for_inputs(PDL)
    if MODE == 0:
        n_out = N
    else:
        n_out = N // 2
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_out
    first, second = _paired_rows(offs, n_out, MODE, HALF, HEAD_DIM)
    y = tl.zeros([BLOCK], dtype=tl.float32)
    y2 = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        y += tl.load(part_ptr + s * N + first, mask=mask, other=0.0)
        if MODE != 0:
            y2 += tl.load(part_ptr + s * N + second, mask=mask, other=0.0)
    kv_ks = 1.0
    kv_vs = 1.0
    if KV_FP8:
        kv_ks = load_scale(k_scale, K_SCALE_PTR)
        kv_vs = load_scale(v_scale, V_SCALE_PTR)
    _epilogue(
        y, y2, offs, mask, first, second, bias_ptr, out_ptr, pos_ptr, cos_sin_ptr, k_cache_ptr,
        v_cache_ptr, slot_ptr, qn_ptr, kn_ptr, qk_eps, cos_sin_stride, cache_stride_slot,
        num_heads, num_kv_heads, kv_ks, kv_vs, HAS_BIAS, MODE, HALF, HEAD_DIM, KV_FP8,
    )  # fmt: skip


def early_columns(
    block_k: int, k_per_split: int, config: dict[str, int], pdl_on: bool = True
) -> int:
    """Columns a program loads before waiting on the kernel before (programmatic dependent
    launch): the launch shape's `early`, else `ATOM_GEMV_EARLY`, else 1,024 where the kernels
    launch with PDL and one step elsewhere (nothing to overlap there: AMD GPUs, older NVIDIA
    ones, the interpreter); rounded down to a power-of-two multiple of block_k (one step at
    least), at most the split's columns rounded up to one. On an H200, W2 with 1,024 against
    one 128-column step, same call: Qwen3-0.6B 0.939 -> 0.858 ms/token (K = 1,024: a program's
    whole slice is in flight before the wait), the Qwen3.5-4B-shaped hybrid 2.867 -> 2.743,
    Llama-3.1-8B 4.291 -> 4.298 (512 lost on all three: 0.990, 3.022, 4.372)."""
    default = "1024" if pdl_on else "0"
    want = int(config.get("early", envs.GEMV_EARLY.value() or default)) or block_k
    cap = triton.next_power_of_2(triton.cdiv(k_per_split, block_k)) * block_k
    early = block_k
    while early * 2 <= min(want, cap):
        early *= 2
    return early


def gemv_config(
    n: int, k: int, multiprocessors: int, fp8: bool = False, block_scaled: bool = False
) -> dict[str, int]:
    """Launch shape from the matrix shape (and whether the weight is FP8, block-scaled or not)
    alone, so CUDA graphs stay valid: the one timed at start-up for this shape
    (`set_launch_shape`), else the rule's (`rule_config`, `fp8_rule_config`)."""
    tuned = _launch_shapes.get((n, k, fp8, fp8 and block_scaled))
    if tuned is not None:
        return dict(tuned)
    if fp8:
        return fp8_rule_config(n, k, multiprocessors, block_scaled=block_scaled)
    return rule_config(n, k, multiprocessors)


def rule_config(
    n: int,
    k: int,
    multiprocessors: int,
    block_n: int = 16,
    block_k: int = 128,
    num_warps: int = 8,
    min_split_columns: int = 1024,
) -> dict[str, int]:
    """By default 16 rows per program, 128 columns a step with 8 warps and 4 pipeline stages
    (the best of a 108-point sweep on an H200 with weights streaming from memory,
    `benchmarks/gemv_sweep.py`); K split until there are about four programs per
    multiprocessor, each split keeping at least 1,024 columns."""
    programs = triton.cdiv(n, block_n)
    split = 1
    while programs * split < 4 * multiprocessors and k // (split * 2) >= min_split_columns:
        split *= 2
    return {
        "block_n": block_n,
        "block_k": block_k,
        "split": split,
        "num_warps": num_warps,
        "num_stages": 4,
    }


def fp8_rule_config(
    n: int,
    k: int,
    multiprocessors: int,
    block_n: int = 16,
    block_k: int = 256,
    num_warps: int = 8,
    min_split_columns: int = 1024,
    block_scaled: bool = False,
) -> dict[str, int]:
    """The FP8 weight's rule: 16 rows of 256 columns a step (16 contiguous bytes a thread at 8
    warps), K split until about four programs a multiprocessor with at least 1,024 columns a
    split. Block-scaled weights step 128 columns, inside one scale block. On an H200
    (`kernels_bench.py --sweep fp8`, 2026-12-03) 16 x 256 beat the first rule's 32 x 128 on
    every Llama-3.1-8B projection (gate_up 49.0 against 67.6 us, down 27.4 against 33.6,
    lm_head 183 against 259) and a 2,048-column split floor left Qwen3-0.6B's 1024 x 2048 o_proj
    at 32 programs (5.1 us, slower than bf16's 3.2)."""
    if block_scaled:
        block_k = min(block_k, 128)
    return rule_config(n, k, multiprocessors, block_n, block_k, num_warps, min_split_columns)


def fp8_launch_candidates(
    n: int, k: int, multiprocessors: int, block_scaled: bool
) -> list[dict[str, int]]:
    """The launch shapes worth timing for an FP8 [n, k] weight, the rule's first: 4 warps, 8
    and 32 rows, 512-column steps (per-row scales only: a step across scale blocks is what block
    scales cannot take), a lower split floor for narrow weights."""
    variants = [{}, {"num_warps": 4}, {"block_n": 8}, {"block_n": 32}, {"min_split_columns": 512}]
    if not block_scaled:
        variants += [{"block_k": 512}, {"block_n": 8, "block_k": 512}]
    shapes = [
        fp8_rule_config(n, k, multiprocessors, block_scaled=block_scaled, **v) for v in variants
    ]
    return [c for i, c in enumerate(shapes) if c not in shapes[:i]]


def launch_candidates(n: int, k: int, multiprocessors: int) -> list[dict[str, int]]:
    """The launch shapes worth timing for an [n, k] weight, the rule's first. No one shape wins
    everywhere: on an H200 (`gemv_sweep.py --shapes`, `tune_gemv_launch`'s log) 4 warps took
    25.4 us for an 18432 x 2560 gate_up against 30.2 with 8, while 8 won on a 12352 x 2560
    in_proj (18.7 against 23.5); 256-column steps won on a 2560 x 9216 down (14.3 against 17.0);
    8 rows a program on Qwen3-0.6B's 1024 x 2048 o_proj (4.3 against 5.6), and on every
    projection of Llama-3.1-8B and the Qwen3.5-4B-shaped hybrid. Eight rows with 256-column
    steps or 4 warps, and four rows with 4 warps, won on none of those (2026-12-02,
    `run_h200.sh w2shapes` with them added)."""
    variants = ({}, {"num_warps": 4}, {"block_k": 256}, {"block_n": 8})
    shapes = [rule_config(n, k, multiprocessors, **v) for v in variants]
    return [c for i, c in enumerate(shapes) if c not in shapes[:i]]


# Launch shapes timed at start-up, by weight shape and whether it is FP8 (the runtime's small_m
# sets them before any CUDA graph is captured; graphs keep the shape they captured).
_launch_shapes: dict[tuple[int, int, bool, bool], dict[str, int]] = {}


def set_launch_shape(
    n: int,
    k: int,
    config: dict[str, int] | None,
    fp8: bool = False,
    block_scaled: bool = False,
) -> None:
    """Use `config` (one of `launch_candidates`, or `fp8_launch_candidates` with `fp8`) for every
    later launch on an [n, k] weight but the QK-norm epilogue's (one head a program); None goes
    back to the rule."""
    key = (n, k, fp8, fp8 and block_scaled)
    if config is None:
        _launch_shapes.pop(key, None)
    else:
        _launch_shapes[key] = dict(config)


def norm_rope_config(n: int, k: int, head_dim: int, multiprocessors: int) -> dict[str, int]:
    """Launch shape of the QK-norm + rotary epilogue: a program owns one head (head_dim rows),
    so there are few programs (32 for Qwen3-0.6B's qkv); K is split until there are about two
    per multiprocessor, each split keeping at least 128 columns (Qwen3-0.6B: 8 splits of 128,
    256 programs streaming 32 KB each, as many and as large as the plain GEMV's)."""
    block_k = 128 if head_dim <= 128 else 64
    programs = triton.cdiv(n, head_dim)
    split = 1
    while programs * split < 2 * multiprocessors and k // (split * 2) >= block_k:
        split *= 2
    return {
        "block_n": head_dim,
        "block_k": block_k,
        "split": split,
        "num_warps": 8,
        "num_stages": 4,
    }


def split_k(k: int, split: int, block_k: int) -> tuple[int, int]:
    """(columns per split, splits launched) for `split` requested splits of K: each split a
    whole number of BLOCK_K steps, so fewer may be launched than asked for, none empty."""
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    return k_per_split, triton.cdiv(k, k_per_split)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    act: str | None = None,
    rope: RopeStore | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    split: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    norm_weight: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    eps: float = 1e-6,
    merge: str = "tickets",
    early: int | None = None,
    weight_scale: torch.Tensor | None = None,
    weight_block_size: tuple[int, int] | list[int] | None = None,
):
    """See `atom_kernels.ops.linear_small_m` and `ops.linear_rope_store_small_m`. Keyword-only
    arguments override the launch shape (tests use them to reach the split path on small
    matrices); `block_n` counts weight rows a program streams (a paired epilogue's program
    finishes block_n // 2 outputs; with QK-norm it must be head_dim, one head). Shapes are
    checked by the caller. `act="silu_mul"` returns silu(gate) * up of
    the [gate; up] rows, [1, N / 2]; `rope` returns the qkv row with q and k rotated and stores
    k and v into the cache. With `norm_weight` (RMSNorm fused in front) returns
    (y, x + residual) when `residual` is given, else y. `merge` picks how split-K partial rows
    are summed: "tickets" (in the kernel) or "kernel" (a second launch). `early` overrides the
    columns loaded before the wait (`early_columns`).

    An FP8 weight comes with `weight_scale` (and `weight_block_size` for block scales): the
    kernel streams its bytes and multiplies in fp32, the per-row scale applied to each row's
    sum, a block scale to x's slice of each step (weight-only dequantization: x stays in its
    dtype)."""
    if merge not in ("tickets", "kernel"):
        raise ValueError(f"merge={merge!r}: expected 'tickets' or 'kernel'")
    if act not in (None, "silu_mul"):
        raise ValueError(f"act={act!r}: expected None or 'silu_mul'")
    if act is not None and rope is not None:
        raise ValueError("act and rope cannot be combined")
    norm = norm_weight is not None
    if norm and weight.shape[1] > MAX_NORM_ROW:
        raise ValueError(f"norm_weight: rows of {weight.shape[1]} exceed {MAX_NORM_ROW}")
    residual_out = torch.empty_like(x) if norm and residual is not None else None
    n, k = weight.shape
    mode = SWIGLU if act == "silu_mul" else PLAIN
    if rope is not None:
        mode = ROPE if rope.q_norm_weight is None else NORM_ROPE
    n_out = n if mode == PLAIN else n // 2
    out = torch.empty((1, n if mode >= ROPE else n_out), dtype=x.dtype, device=x.device)
    if mode == NORM_ROPE:
        head_dim = rope.head_dim
        if head_dim & (head_dim - 1) or block_n not in (None, head_dim):
            raise ValueError(
                f"QK-norm in the epilogue needs a power-of-two head_dim ({head_dim}) and "
                f"block_n = head_dim (got {block_n})"
            )
        cfg = norm_rope_config(n, k, head_dim, _multiprocessors(x.device))
    else:
        cfg = gemv_config(
            n,
            k,
            _multiprocessors(x.device),
            fp8=is_fp8(weight),
            block_scaled=weight_block_size is not None,
        )
    block_n = block_n or cfg["block_n"]
    block_k = block_k or cfg["block_k"]
    split = split or cfg["split"]
    k_per_split, split = split_k(k, split, block_k)
    if mode != PLAIN and (block_n < 2 or block_n & (block_n - 1)):
        raise ValueError(f"block_n={block_n}: a paired epilogue needs a power of two >= 2")
    fp8 = fp8_weight(weight, weight_scale, weight_block_size)
    same_block = True
    if fp8 is not None and fp8.mode == 2:
        half = rope.head_dim // 2 if rope is not None else 1
        same_block = check_block_scaled_launch(fp8, mode, block_n, block_k, n_out, half)
    programs_n = triton.cdiv(n_out, block_n if mode == PLAIN else block_n // 2)
    parts = tickets = None
    if split > 1:
        parts = torch.empty((split, n), dtype=torch.float32, device=x.device)
        tickets = ticket_counters(x.device, programs_n) if merge == "tickets" else None
    if rope is not None:
        rope_args = (rope.positions, rope.cos_sin_cache, rope.k_cache, rope.v_cache)
        rope_args += (rope.slot_mapping,)
        if mode == NORM_ROPE:
            rope_args += (rope.q_norm_weight, rope.k_norm_weight)
        else:
            rope_args += (out, out)
        rope_ints = (rope.cos_sin_cache.stride(0), rope.k_cache.stride(1))
        rope_ints += (rope.num_heads, rope.num_kv_heads)
        half, head_dim, qk_eps = rope.head_dim // 2, rope.head_dim, rope.qk_norm_eps
    else:
        rope_args, rope_ints, half, head_dim = (out,) * 7, (0, 0, 0, 0), 1, 2
        qk_eps = 0.0
    consts = dict(HAS_BIAS=bias is not None, MODE=mode, HALF=half, HEAD_DIM=head_dim)
    kv_args, kv_consts = _kv_scale_args(rope)
    _gemv_kernel[(programs_n, split)](
        x, weight, bias if bias is not None else weight, out,
        residual if residual is not None else x, norm_weight if norm else x,
        residual_out if residual_out is not None else x, parts if parts is not None else out,
        tickets if tickets is not None else out, *rope_args, fp8.scale if fp8 is not None else out,
        n, k, weight.stride(0), fp8.stride if fp8 is not None else 0, k_per_split, eps, qk_eps,
        *rope_ints, *kv_args, NORM=norm, HAS_RESIDUAL=residual_out is not None, SPLIT=split,
        TICKETS=tickets is not None, BLOCK_N=block_n, BLOCK_K=block_k,
        ROW_BLOCK=triton.next_power_of_2(k) if norm else 1, num_warps=num_warps or cfg["num_warps"],
        num_stages=num_stages or cfg["num_stages"],
        EARLY=early_columns( block_k, k_per_split, cfg if early is None else {"early": early}, pdl.enabled(x.device) ),
        W_SCALE=fp8.mode if fp8 is not None else 0,
        SCALE_BN=fp8.block_n if fp8 is not None else 128,
        SCALE_BK=fp8.block_k if fp8 is not None else 128, SAME_BLOCK=same_block, **kv_consts,
        **consts, **pdl.options(x.device),
    )  # fmt: skip
    if split > 1 and tickets is None:
        block = half if mode == NORM_ROPE else 1024  # QK-norm's epilogue: one head a program
        _gemv_reduce_kernel[(triton.cdiv(n_out, block),)](
            parts, bias if bias is not None else parts, out, *rope_args, n, qk_eps, *rope_ints,
            *kv_args, SPLIT=split, BLOCK=block, num_warps=4, **kv_consts, **consts,
            **pdl.options(x.device),
        )  # fmt: skip
    return out if residual_out is None else (out, residual_out)


def _kv_scale_args(rope: RopeStore | None) -> tuple[tuple, dict[str, bool]]:
    """The cache epilogue's (k_scale, v_scale) arguments and their constexprs."""
    if rope is None or not is_fp8(rope.k_cache):
        return (1.0, 1.0), {"KV_FP8": False}
    (k_arg, k_ptr), (v_arg, v_ptr) = scale_arg(rope.k_scale), scale_arg(rope.v_scale)
    return (k_arg, v_arg), {"KV_FP8": True, "K_SCALE_PTR": k_ptr, "V_SCALE_PTR": v_ptr}


def linear_small_m(x, weight, bias=None, *, act=None, weight_scale=None, weight_block_size=None):
    """See `atom_kernels.ops.linear_small_m`."""
    return gemv(
        x, weight, bias, act=act, weight_scale=weight_scale, weight_block_size=weight_block_size
    )


def linear_rope_store_small_m(
    x, weight, bias, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, num_heads,
    num_kv_heads, head_dim, q_norm_weight=None, k_norm_weight=None, eps=1e-06, *, weight_scale=None,
    weight_block_size=None, k_scale=1.0, v_scale=1.0,
):  # fmt: skip
    """See `atom_kernels.ops.linear_rope_store_small_m`."""
    rope = RopeStore(
        positions, cos_sin_cache, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads,
        head_dim, q_norm_weight, k_norm_weight, eps, k_scale, v_scale,
    )  # fmt: skip
    return gemv(
        x, weight, bias, rope=rope, weight_scale=weight_scale, weight_block_size=weight_block_size
    )


def rms_norm_linear_rope_store_small_m(
    x, residual, norm_weight, eps, weight, bias, positions, cos_sin_cache, k_cache, v_cache,
    slot_mapping, num_heads, num_kv_heads, head_dim, q_norm_weight=None, k_norm_weight=None,
    qk_eps=1e-06, *, weight_scale=None, weight_block_size=None, k_scale=1.0, v_scale=1.0,
):  # fmt: skip
    """See `atom_kernels.ops.rms_norm_linear_rope_store_small_m`: one launch with the norm in
    the GEMV's prologue, or, for a row too long for it to hold, the Triton norm and then the
    GEMV."""
    rope = RopeStore(
        positions, cos_sin_cache, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads,
        head_dim, q_norm_weight, k_norm_weight, qk_eps, k_scale, v_scale,
    )  # fmt: skip
    return _normed_gemv(
        x, residual, norm_weight, eps, weight, bias, rope=rope, weight_scale=weight_scale,
        weight_block_size=weight_block_size,
    )  # fmt: skip


def rms_norm_linear_small_m(
    x, residual, norm_weight, eps, weight, bias=None, *, act=None, weight_scale=None,
    weight_block_size=None,
):  # fmt: skip
    """See `atom_kernels.ops.rms_norm_linear_small_m`: one launch with the norm inside the GEMV,
    or, for a row too long for the GEMV to hold, the Triton norm and then the GEMV."""
    return _normed_gemv(
        x, residual, norm_weight, eps, weight, bias, act=act, weight_scale=weight_scale,
        weight_block_size=weight_block_size,
    )  # fmt: skip


def _normed_gemv(x, residual, norm_weight, eps, weight, bias, **epilogue):
    """The RMSNorm (after adding `residual`, when given) then the GEMV with `epilogue`: the norm
    in the GEMV's prologue, or, for a row longer than MAX_NORM_ROW, the Triton norm first.
    Returns (y, x + residual), or (y, x) without a residual."""
    if weight.shape[1] <= MAX_NORM_ROW:
        out = gemv(x, weight, bias, norm_weight=norm_weight, residual=residual, eps=eps, **epilogue)
        return out if residual is not None else (out, x)
    if residual is None:
        return gemv(norm.rms_norm(x, norm_weight, eps), weight, bias, **epilogue), x
    normed, total = norm.fused_add_rms_norm(x, residual.clone(), norm_weight, eps)
    return gemv(normed, weight, bias, **epilogue), total

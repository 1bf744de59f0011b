"""Triton rotary position embedding, applied to q and k in place."""

from __future__ import annotations

import triton
import triton.language as tl

from atom_kernels import pdl
from atom_kernels.pdl import wait_for_inputs


@triton.jit
def load_cos_sin(
    cache_ptr, cache_stride, positions_ptr, token, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr
):
    """The cos and sin halves of `token`'s position (from `positions_ptr`) in a
    `[max_position, 2 * HALF]` cos/sin cache, fp32 `[BLOCK_HALF]`, zeros past HALF."""
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    mask = offs < HALF
    row = cache_ptr + pos * cache_stride
    cos = tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(row + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    return cos, sin


@triton.jit
def _rotate_heads(
    x_ptr, token, stride_t, stride_h, stride_d, num_heads, cos, sin, HALF: tl.constexpr,
    IS_NEOX: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    offs_h = tl.arange(0, BLOCK_H)
    offs_i = tl.arange(0, BLOCK_HALF)
    if IS_NEOX:  # channel i pairs with i + HALF
        first = offs_i
        second = offs_i + HALF
    else:  # GPT-J: channel 2i pairs with 2i + 1
        first = 2 * offs_i
        second = 2 * offs_i + 1
    mask = (offs_h[:, None] < num_heads) & (offs_i[None, :] < HALF)
    base = x_ptr + token.to(tl.int64) * stride_t + offs_h[:, None] * stride_h
    p1 = base + first[None, :] * stride_d
    p2 = base + second[None, :] * stride_d
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    y1 = x1 * cos[None, :] - x2 * sin[None, :]
    y2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(p1, y1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(p2, y2.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr, q_ptr, k_ptr, cache_ptr, q_stride_t, q_stride_h, q_stride_d, k_stride_t,
    k_stride_h, k_stride_d, cache_stride, num_heads, num_kv_heads, HALF: tl.constexpr,
    IS_NEOX: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KV_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    wait_for_inputs(PDL)
    # One program per token: its cos/sin row is loaded once for every q and k head.
    token = tl.program_id(0)
    cos, sin = load_cos_sin(cache_ptr, cache_stride, positions_ptr, token, HALF, BLOCK_HALF)
    _rotate_heads(
        q_ptr,
        token,
        q_stride_t,
        q_stride_h,
        q_stride_d,
        num_heads,
        cos,
        sin,
        HALF,
        IS_NEOX,
        BLOCK_H,
        BLOCK_HALF,
    )
    _rotate_heads(
        k_ptr,
        token,
        k_stride_t,
        k_stride_h,
        k_stride_d,
        num_kv_heads,
        cos,
        sin,
        HALF,
        IS_NEOX,
        BLOCK_KV_H,
        BLOCK_HALF,
    )


def rotary_embedding_(positions, q, k, cos_sin_cache, is_neox=True):
    """See `atom_kernels.ops.rotary_embedding_`."""
    num_tokens, num_heads, _ = q.shape
    num_kv_heads = k.shape[1]
    if cos_sin_cache.stride(-1) != 1:
        raise ValueError("cos_sin_cache must have a contiguous last dim")
    if num_tokens == 0:
        return
    half = cos_sin_cache.shape[-1] // 2
    block_half = triton.next_power_of_2(half)
    block_h = triton.next_power_of_2(num_heads)
    _rotary_kernel[(num_tokens,)](
        positions, q, k, cos_sin_cache, *q.stride(), *k.stride(), cos_sin_cache.stride(0),
        num_heads, num_kv_heads, HALF=half, IS_NEOX=is_neox, BLOCK_H=block_h,
        BLOCK_KV_H=triton.next_power_of_2(num_kv_heads), BLOCK_HALF=block_half,
        num_warps=4 if block_h * block_half >= 1024 else 1, **pdl.options(q.device),
    )  # fmt: skip

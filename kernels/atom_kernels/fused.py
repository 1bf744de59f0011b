"""Fused Triton kernels for the decode hot path, where launch count, not bandwidth, sets the pace
at small batches:

- `qk_norm_rope_store_`: for each token, optional per-head RMSNorm of q and k (Qwen3's QK-norm),
  rotary embedding of q and k (neox style), and the write of k and v into the paged cache — one
  launch instead of up to six (two reshape copies, two norms, rotary, cache store).
- `silu_and_mul`: SwiGLU's `silu(gate) * up` over a fused gate_up projection — one launch
  instead of two, and no intermediate tensor.

Numerics follow the unfused path: the normed q/k are rounded to the activation dtype before
rotation, exactly as the separate norm kernel's output would be.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _norm_rope_heads(
    base,
    w_ptr,
    num_heads,
    cos,
    sin,
    eps,
    HAS_NORM: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Norm (optional) and rotate `num_heads` contiguous heads at `base` in place; returns the
    rotated halves in fp32 (rows = heads)."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_i = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < num_heads) & (offs_i[None, :] < HALF)
    p1 = base + offs_h[:, None] * HEAD_DIM + offs_i[None, :]
    p2 = p1 + HALF
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        inv = 1.0 / tl.sqrt(ss / HEAD_DIM + eps)
        w1 = tl.load(w_ptr + offs_i, mask=offs_i < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + offs_i, mask=offs_i < HALF, other=0.0).to(tl.float32)
        x1 = (x1 * inv[:, None] * w1[None, :]).to(base.dtype.element_ty).to(tl.float32)
        x2 = (x2 * inv[:, None] * w2[None, :]).to(base.dtype.element_ty).to(tl.float32)
    y1 = x1 * cos[None, :] - x2 * sin[None, :]
    y2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(p1, y1.to(base.dtype.element_ty), mask=mask)
    tl.store(p2, y2.to(base.dtype.element_ty), mask=mask)
    return y1, y2


@triton.jit
def _qk_prep_kernel(
    qkv_ptr,
    positions_ptr,
    cos_sin_ptr,
    q_w_ptr,
    k_w_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    qkv_stride_t,
    cos_sin_stride,
    cache_stride_slot,
    eps,
    num_heads,
    num_kv_heads,
    HAS_NORM: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs_i = tl.arange(0, BLOCK_HALF)
    cs_mask = offs_i < HALF
    cos = tl.load(cos_sin_ptr + pos * cos_sin_stride + offs_i, mask=cs_mask, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * cos_sin_stride + HALF + offs_i, mask=cs_mask, other=0.0)
    cos = cos.to(tl.float32)
    sin = sin.to(tl.float32)
    row = qkv_ptr + token.to(tl.int64) * qkv_stride_t
    _norm_rope_heads(
        row, q_w_ptr, num_heads, cos, sin, eps, HAS_NORM, HEAD_DIM, HALF, BLOCK_HQ, BLOCK_HALF
    )
    k_row = row + num_heads * HEAD_DIM
    k1, k2 = _norm_rope_heads(
        k_row, k_w_ptr, num_kv_heads, cos, sin, eps, HAS_NORM, HEAD_DIM, HALF, BLOCK_HK, BLOCK_HALF
    )
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:  # -1: a padding row, nothing to cache
        offs_h = tl.arange(0, BLOCK_HK)
        mask = (offs_h[:, None] < num_kv_heads) & (offs_i[None, :] < HALF)
        within = offs_h[:, None] * HEAD_DIM + offs_i[None, :]
        kc = k_cache_ptr + slot * cache_stride_slot + within
        tl.store(kc, k1.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(kc + HALF, k2.to(k_cache_ptr.dtype.element_ty), mask=mask)
        v_src = k_row + num_kv_heads * HEAD_DIM + within
        vc = v_cache_ptr + slot * cache_stride_slot + within
        tl.store(vc, tl.load(v_src, mask=mask, other=0.0), mask=mask)
        tl.store(vc + HALF, tl.load(v_src + HALF, mask=mask, other=0.0), mask=mask)


def qk_norm_rope_store_(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> None:
    """See `atom_kernels.ops.qk_norm_rope_store_`."""
    num_tokens = qkv.shape[0]
    if num_tokens == 0:
        return
    has_norm = q_norm_weight is not None
    half = head_dim // 2
    block_hq = triton.next_power_of_2(num_heads)
    _qk_prep_kernel[(num_tokens,)](
        qkv,
        positions,
        cos_sin_cache,
        q_norm_weight if has_norm else qkv,
        k_norm_weight if has_norm else qkv,
        k_cache,
        v_cache,
        slot_mapping,
        qkv.stride(0),
        cos_sin_cache.stride(0),
        k_cache.stride(1),
        eps,
        num_heads,
        num_kv_heads,
        HAS_NORM=has_norm,
        HEAD_DIM=head_dim,
        HALF=half,
        BLOCK_HQ=block_hq,
        BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
        num_warps=4 if block_hq * half >= 1024 else 1,
    )


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride_t, out_stride_t, width, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < width
    row = x_ptr + token.to(tl.int64) * x_stride_t
    gate = tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + width + offs, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(
        out_ptr + token.to(tl.int64) * out_stride_t + offs,
        y.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """See `atom_kernels.ops.silu_and_mul`."""
    num_tokens, two_width = x.shape
    width = two_width // 2
    out = torch.empty((num_tokens, width), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block = min(1024, triton.next_power_of_2(width))
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(width, block))](
        x, out, x.stride(0), out.stride(0), width, BLOCK=block, num_warps=4
    )
    return out

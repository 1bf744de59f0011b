"""Fused Triton kernels for the decode hot path, where launch count, not bandwidth, sets the pace
at small batches:

- `qk_norm_rope_store_`: for each token, optional per-head RMSNorm of q and k (Qwen3's QK-norm),
  rotary embedding of q and k (neox style, over all of head_dim or its first rotary_dim
  channels), and the write of k and v into the paged cache — one launch instead of up to six
  (two reshape copies, two norms, rotary, cache store). q heads may be interleaved with
  gated attention's output gates ([query; gate] per head, as Qwen3.5/Next's q_proj gives them).
- `silu_and_mul`: SwiGLU's `silu(gate) * up` over a fused gate_up projection — one launch
  instead of two, and no intermediate tensor.
- `sigmoid_gate_mul`: gated attention's `out * sigmoid(gate)`, reading the gate where q_proj
  left it (interleaved with the queries) — one launch instead of a copy, a sigmoid and a multiply.

Numerics follow the unfused path: the normed q/k are rounded to the activation dtype before
rotation, exactly as the separate norm kernel's output would be.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_kernels import pdl
from atom_kernels.fp8_formats import is_fp8
from atom_kernels.fp8_quant import load_scale, scale_arg, store_kv_fp8
from atom_kernels.pdl import wait_for_inputs
from atom_kernels.rotary import load_cos_sin


@triton.jit
def _norm_rope_heads(
    base, w_ptr, num_heads, cos, sin, eps, HAS_NORM: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_STRIDE: tl.constexpr, ROT_HALF: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_ROT: tl.constexpr, BLOCK_REST: tl.constexpr,
):  # fmt: skip
    """Norm (optional) and rotate, in place, `num_heads` heads starting at `base`, HEAD_STRIDE
    apart: channels i and i + ROT_HALF (i < ROT_HALF) rotate as a neox pair, channels from
    2 * ROT_HALF on (partial rotary) are only normed. Returns the three pieces as written, in
    fp32 (rows = heads): the rotated first and second halves and the rest."""
    rest = HEAD_DIM - 2 * ROT_HALF
    offs_h = tl.arange(0, BLOCK_H)
    offs_i = tl.arange(0, BLOCK_ROT)
    offs_r = tl.arange(0, BLOCK_REST)
    h_ok = offs_h[:, None] < num_heads
    mask = h_ok & (offs_i[None, :] < ROT_HALF)
    mask_r = h_ok & (offs_r[None, :] < rest)
    head = base + offs_h[:, None] * HEAD_STRIDE
    p1 = head + offs_i[None, :]
    p2 = p1 + ROT_HALF
    p3 = head + 2 * ROT_HALF + offs_r[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    x3 = tl.load(p3, mask=mask_r, other=0.0).to(tl.float32)
    if HAS_NORM:
        ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1) + tl.sum(x3 * x3, axis=1)
        inv = 1.0 / tl.sqrt(ss / HEAD_DIM + eps)
        w1 = tl.load(w_ptr + offs_i, mask=offs_i < ROT_HALF, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + ROT_HALF + offs_i, mask=offs_i < ROT_HALF, other=0.0).to(tl.float32)
        w3 = tl.load(w_ptr + 2 * ROT_HALF + offs_r, mask=offs_r < rest, other=0.0)
        x1 = (x1 * inv[:, None] * w1[None, :]).to(base.dtype.element_ty).to(tl.float32)
        x2 = (x2 * inv[:, None] * w2[None, :]).to(base.dtype.element_ty).to(tl.float32)
        x3 = (x3 * inv[:, None] * w3.to(tl.float32)[None, :]).to(base.dtype.element_ty)
        tl.store(p3, x3, mask=mask_r)
        x3 = x3.to(tl.float32)
    y1 = x1 * cos[None, :] - x2 * sin[None, :]
    y2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(p1, y1.to(base.dtype.element_ty), mask=mask)
    tl.store(p2, y2.to(base.dtype.element_ty), mask=mask)
    return y1, y2, x3


@triton.jit
def _qk_prep_kernel(
    qkv_ptr, positions_ptr, cos_sin_ptr, q_w_ptr, k_w_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    qkv_stride_t, cos_sin_stride, cache_stride_slot, eps, num_heads, num_kv_heads, k_scale, v_scale,
    HAS_NORM: tl.constexpr, HEAD_DIM: tl.constexpr, Q_HEAD_STRIDE: tl.constexpr,
    ROT_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_ROT: tl.constexpr,
    BLOCK_REST: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False,
    FP8: tl.constexpr = False, K_SCALE_PTR: tl.constexpr = False, V_SCALE_PTR: tl.constexpr = False,
):  # fmt: skip
    wait_for_inputs(PDL)
    token = tl.program_id(0)
    cos, sin = load_cos_sin(cos_sin_ptr, cos_sin_stride, positions_ptr, token, ROT_HALF, BLOCK_ROT)
    offs_i = tl.arange(0, BLOCK_ROT)
    row = qkv_ptr + token.to(tl.int64) * qkv_stride_t
    _norm_rope_heads(
        row, q_w_ptr, num_heads, cos, sin, eps, HAS_NORM, HEAD_DIM, Q_HEAD_STRIDE, ROT_HALF,
        BLOCK_HQ, BLOCK_ROT, BLOCK_REST,
    )  # fmt: skip
    k_row = row + num_heads * Q_HEAD_STRIDE
    k1, k2, k3 = _norm_rope_heads(
        k_row, k_w_ptr, num_kv_heads, cos, sin, eps, HAS_NORM, HEAD_DIM, HEAD_DIM, ROT_HALF,
        BLOCK_HK, BLOCK_ROT, BLOCK_REST,
    )  # fmt: skip
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:  # -1: a padding row, nothing to cache
        offs_h = tl.arange(0, BLOCK_HK)[:, None]
        offs_r = tl.arange(0, BLOCK_REST)[None, :]
        h_ok = offs_h < num_kv_heads
        mask = h_ok & (offs_i[None, :] < ROT_HALF)
        kc = k_cache_ptr + slot * cache_stride_slot + offs_h * HEAD_DIM
        # k as the unfused path caches it: rounded to the activation dtype first (as written
        # into qkv), then cast, or quantized into an FP8 cache.
        act = qkv_ptr.dtype.element_ty
        ks = 1.0
        vs = 1.0
        if FP8:
            ks = load_scale(k_scale, K_SCALE_PTR)
            vs = load_scale(v_scale, V_SCALE_PTR)
        store_kv_fp8(kc + offs_i[None, :], k1.to(act), mask, ks, FP8)
        store_kv_fp8(kc + ROT_HALF + offs_i[None, :], k2.to(act), mask, ks, FP8)
        rest_mask = h_ok & (offs_r < HEAD_DIM - 2 * ROT_HALF)
        store_kv_fp8(kc + 2 * ROT_HALF + offs_r, k3.to(act), rest_mask, ks, FP8)
        offs_d = tl.arange(0, BLOCK_D)[None, :]
        within = offs_h * HEAD_DIM + offs_d
        v_mask = h_ok & (offs_d < HEAD_DIM)
        v = tl.load(k_row + num_kv_heads * HEAD_DIM + within, mask=v_mask, other=0.0)
        store_kv_fp8(v_cache_ptr + slot * cache_stride_slot + within, v, v_mask, vs, FP8)


def qk_norm_rope_store_(
    qkv, positions, cos_sin_cache, q_norm_weight, k_norm_weight, eps, k_cache, v_cache,
    slot_mapping, num_heads, num_kv_heads, head_dim, q_gate=False, *, k_scale=1.0, v_scale=1.0,
):  # fmt: skip
    """See `atom_kernels.ops.qk_norm_rope_store_`."""
    num_tokens = qkv.shape[0]
    if cos_sin_cache.stride(-1) != 1:
        raise ValueError("cos_sin_cache must have a contiguous last dim")
    if num_tokens == 0:
        return
    has_norm = q_norm_weight is not None
    rot_half = cos_sin_cache.shape[-1] // 2
    block_hq = triton.next_power_of_2(num_heads)
    k_arg, k_ptr = scale_arg(k_scale)
    v_arg, v_ptr = scale_arg(v_scale)
    _qk_prep_kernel[(num_tokens,)](
        qkv, positions, cos_sin_cache, q_norm_weight if has_norm else qkv,
        k_norm_weight if has_norm else qkv, k_cache, v_cache, slot_mapping, qkv.stride(0),
        cos_sin_cache.stride(0), k_cache.stride(1), eps, num_heads, num_kv_heads, k_arg, v_arg,
        HAS_NORM=has_norm, HEAD_DIM=head_dim, Q_HEAD_STRIDE=(2 if q_gate else 1) * head_dim,
        ROT_HALF=rot_half, BLOCK_HQ=block_hq, BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        BLOCK_ROT=triton.next_power_of_2(rot_half),
        BLOCK_REST=triton.next_power_of_2(max(1, head_dim - 2 * rot_half)),
        BLOCK_D=triton.next_power_of_2(head_dim), num_warps=4 if block_hq * head_dim >= 2048 else 1,
        FP8=is_fp8(k_cache), K_SCALE_PTR=k_ptr, V_SCALE_PTR=v_ptr, **pdl.options(qkv.device),
    )  # fmt: skip


@triton.jit
def _sigmoid_gate_mul_kernel(
    x_ptr, gate_ptr, out_ptr, x_stride_t, x_stride_h, gate_stride_t, gate_stride_h, width,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    wait_for_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < width
    head, d = offs // HEAD_DIM, offs % HEAD_DIM
    x = tl.load(x_ptr + token * x_stride_t + head * x_stride_h + d, mask=mask, other=0.0)
    gate = tl.load(
        gate_ptr + token * gate_stride_t + head * gate_stride_h + d, mask=mask, other=0.0
    )
    gate = gate.to(tl.float32)
    y = x.to(tl.float32) / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + token * width + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def sigmoid_gate_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """See `atom_kernels.ops.sigmoid_gate_mul`."""
    num_tokens, heads, head_dim = x.shape
    out = torch.empty((num_tokens, heads, head_dim), dtype=x.dtype, device=x.device)
    width = heads * head_dim
    if num_tokens == 0:
        return out
    block = min(2048, triton.next_power_of_2(width))
    _sigmoid_gate_mul_kernel[(num_tokens, triton.cdiv(width, block))](
        x, gate, out, x.stride(0), x.stride(1), gate.stride(0), gate.stride(1), width,
        HEAD_DIM=head_dim, BLOCK=block, num_warps=4,
        **pdl.options(x.device),
    )  # fmt: skip
    return out


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, x_stride_t, out_stride_t, width, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    wait_for_inputs(PDL)
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
        x, out, x.stride(0), out.stride(0), width, BLOCK=block, num_warps=4,
        **pdl.options(x.device),
    )  # fmt: skip
    return out

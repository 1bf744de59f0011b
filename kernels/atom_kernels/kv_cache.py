"""Triton kernel that scatters new tokens' keys and values into the paged KV cache.

An FP8 cache (float8_e4m3fn / e4m3fnuz) stores `clamp(x / scale)` with the per-tensor k_scale
and v_scale (`fp8_quant.store_kv_fp8`); any other cache dtype stores a cast, scales unused."""

from __future__ import annotations

import triton
import triton.language as tl

from atom_kernels import pdl
from atom_kernels.fp8_formats import is_fp8
from atom_kernels.fp8_quant import load_scale, scale_arg, store_kv_fp8
from atom_kernels.pdl import wait_for_inputs


@triton.jit
def _store_kvcache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, key_stride_t, key_stride_h,
    value_stride_t, value_stride_h, cache_stride_slot, cache_stride_h, k_scale, v_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False,
    FP8: tl.constexpr = False, K_SCALE_PTR: tl.constexpr = False, V_SCALE_PTR: tl.constexpr = False,
):  # fmt: skip
    wait_for_inputs(PDL)
    # One program per (token, kv head): one contiguous head_dim row in, one row out.
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    # slot -1: padding token, write nothing (the slot test is broadcast over the row).
    mask = (offs_d < HEAD_DIM) & ((slot + offs_d * 0) >= 0)
    src = token.to(tl.int64) * key_stride_t + head * key_stride_h + offs_d
    k = tl.load(key_ptr + src, mask=mask)
    src = token.to(tl.int64) * value_stride_t + head * value_stride_h + offs_d
    v = tl.load(value_ptr + src, mask=mask)
    dst = slot * cache_stride_slot + head * cache_stride_h + offs_d
    ks = 1.0
    vs = 1.0
    if FP8:
        ks = load_scale(k_scale, K_SCALE_PTR)
        vs = load_scale(v_scale, V_SCALE_PTR)
    store_kv_fp8(k_cache_ptr + dst, k, mask, ks, FP8)
    store_kv_fp8(v_cache_ptr + dst, v, mask, vs, FP8)


def store_kvcache(key, value, k_cache, v_cache, slot_mapping, *, k_scale=1.0, v_scale=1.0):
    """See `atom_kernels.ops.store_kvcache`."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if key.stride(2) != 1 or value.stride(2) != 1:
        raise ValueError("key/value must have a contiguous head_dim")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError("k_cache and v_cache must share strides with a contiguous head_dim")
    # A slot indexes (block, offset) as one number, so offsets must be evenly strided.
    if k_cache.stride(0) != k_cache.shape[1] * k_cache.stride(1):
        raise ValueError("the cache's block and offset dims must be contiguous with each other")
    if num_tokens == 0:
        return
    k_arg, k_ptr = scale_arg(k_scale)
    v_arg, v_ptr = scale_arg(v_scale)
    _store_kvcache_kernel[(num_tokens, num_kv_heads)](
        key, value, k_cache, v_cache, slot_mapping, key.stride(0), key.stride(1), value.stride(0),
        value.stride(1), k_cache.stride(1), k_cache.stride(2), k_arg, v_arg, HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), num_warps=1 if head_dim <= 128 else 2,
        FP8=is_fp8(k_cache), K_SCALE_PTR=k_ptr, V_SCALE_PTR=v_ptr, **pdl.options(key.device),
    )  # fmt: skip

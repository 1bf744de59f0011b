"""Triton kernel that scatters new tokens' keys and values into the paged KV cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_kernels import pdl
from atom_kernels.pdl import wait_for_inputs


@triton.jit
def _store_kvcache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    key_stride_t,
    key_stride_h,
    value_stride_t,
    value_stride_h,
    cache_stride_slot,
    cache_stride_h,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):
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
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
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
    _store_kvcache_kernel[(num_tokens, num_kv_heads)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=1 if head_dim <= 128 else 2,
        **pdl.options(key.device),
    )

"""Multi-head latent attention (DeepSeek-V2/V3) over a paged latent cache.

The cache holds one row per token per layer, not per head: the normalized KV latent (the
first `latent` channels, kv_lora_rank) followed by the rotated shared rope key (rope channels,
qk_rope_head_dim), as `[num_blocks, block_size, latent + rope]`. Three pieces:

- `mla_rope_store_`: rotary on the query's rope channels (in place) and, per token, RMSNorm of
  the latent plus rotary of the rope key written into the cache row at its slot. One program
  per token.
- `mla_decode_attention`: the absorbed path. A query row is `[q_latent | q_rope]` per head (its
  no-rope part already multiplied by W_UK, so it lives in the latent space), and every head
  attends over the same cache rows: multi-query attention with head dim latent + rope whose
  value is the row's latent part. Grid (row, head block, split); one program takes BLOCK_H
  heads as the rows of its tiles, so each cache row it loads serves every head of the block as
  key and as value. Split-K over the context with the log-sum-exp merge of
  `decode_attention` when rows x head blocks would not fill the GPU; the split count depends on
  shapes and the device only (CUDA-graph safe).
- `mla_prefill_attention`: the up-projected path for long prompt chunks: ordinary causal
  attention with per-head K/V ([k_nope | k_rope], v) that the model expanded from the latents.
  On a GPU it is torch's SDPA per chunk (flash / memory-efficient kernels, lower-right causal),
  not a Triton kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_kernels import pdl
from atom_kernels.decode_attention import (
    _LOG2E,
    _MERGE_SPLITS,
    _decode_merge_kernel,
    _multiprocessor_count,
    choose_num_splits,
)
from atom_kernels.pdl import wait_for_inputs
from atom_kernels.rotary import _rotate_heads, load_cos_sin


@triton.jit
def _mla_rope_store_kernel(
    positions_ptr, q_rope_ptr, kv_a_ptr, cos_sin_ptr, norm_weight_ptr, cache_ptr, slot_mapping_ptr,
    q_stride_t, q_stride_h, q_stride_d, kv_a_stride, cos_sin_stride, cache_stride_slot, num_heads,
    eps, LATENT: tl.constexpr, HALF: tl.constexpr, IS_NEOX: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_HALF: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    wait_for_inputs(PDL)
    token = tl.program_id(0)
    cos, sin = load_cos_sin(cos_sin_ptr, cos_sin_stride, positions_ptr, token, HALF, BLOCK_HALF)
    offs_i = tl.arange(0, BLOCK_HALF)
    cs_mask = offs_i < HALF
    for h0 in range(0, num_heads, BLOCK_H):
        _rotate_heads(
            q_rope_ptr + h0 * q_stride_h, token, q_stride_t, q_stride_h, q_stride_d,
            num_heads - h0, cos, sin, HALF, IS_NEOX, BLOCK_H, BLOCK_HALF,
        )  # fmt: skip

    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:  # -1: a padding token, nothing stored
        row = kv_a_ptr + token.to(tl.int64) * kv_a_stride
        dst = cache_ptr + slot * cache_stride_slot
        offs_l = tl.arange(0, BLOCK_L)
        l_mask = offs_l < LATENT
        x = tl.load(row + offs_l, mask=l_mask, other=0.0).to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / LATENT + eps)
        w = tl.load(norm_weight_ptr + offs_l, mask=l_mask, other=0.0).to(tl.float32)
        tl.store(dst + offs_l, (x * inv_rms * w).to(cache_ptr.dtype.element_ty), mask=l_mask)
        if IS_NEOX:  # channel i pairs with i + HALF
            first = offs_i
            second = offs_i + HALF
        else:  # GPT-J / DeepSeek interleaved: channel 2i pairs with 2i + 1
            first = 2 * offs_i
            second = 2 * offs_i + 1
        k1 = tl.load(row + LATENT + first, mask=cs_mask, other=0.0).to(tl.float32)
        k2 = tl.load(row + LATENT + second, mask=cs_mask, other=0.0).to(tl.float32)
        y1 = k1 * cos - k2 * sin
        y2 = k2 * cos + k1 * sin
        tl.store(dst + LATENT + first, y1.to(cache_ptr.dtype.element_ty), mask=cs_mask)
        tl.store(dst + LATENT + second, y2.to(cache_ptr.dtype.element_ty), mask=cs_mask)


def mla_rope_store_(
    q_rope, kv_a, positions, cos_sin_cache, kv_norm_weight, eps, kv_cache, slot_mapping,
    is_neox=False,
):  # fmt: skip
    """See `atom_kernels.ops.mla_rope_store_`."""
    tokens, num_heads, rope = q_rope.shape
    if tokens == 0:
        return
    latent = kv_cache.shape[2] - rope
    half = rope // 2
    flat = kv_cache.view(-1, kv_cache.shape[2])
    _mla_rope_store_kernel[(tokens,)](
        positions, q_rope, kv_a, cos_sin_cache, kv_norm_weight, flat, slot_mapping,
        q_rope.stride(0), q_rope.stride(1), q_rope.stride(2), kv_a.stride(0),
        cos_sin_cache.stride(0), flat.stride(0), num_heads, eps,
        LATENT=latent, HALF=half, IS_NEOX=is_neox,
        BLOCK_H=min(16, triton.next_power_of_2(num_heads)),
        BLOCK_L=triton.next_power_of_2(latent), BLOCK_HALF=triton.next_power_of_2(half),
        num_warps=4 if latent <= 1024 else 8, **pdl.options(q_rope.device),
    )  # fmt: skip


@triton.jit
def _mla_decode_split_kernel(
    q_latent_ptr, q_rope_ptr, cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr, part_acc_ptr,
    part_max_ptr, part_sum_ptr, scale_log2, ql_stride_b, ql_stride_h, qr_stride_b, qr_stride_h,
    cache_stride_block, cache_stride_off, bt_stride_b, out_stride_b, out_stride_h,
    NUM_HEADS: tl.constexpr, LATENT: tl.constexpr, ROPE: tl.constexpr, PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr, IEEE_DOT: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    wait_for_inputs(PDL)
    seq = tl.program_id(0)
    head0 = tl.program_id(1) * BLOCK_H
    split = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + seq)
    # The same cut of the context as `decode_attention`, so its merge kernel reads the partials.
    tokens_per_split = tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * tokens_per_split
    end = tl.minimum(ctx, start + tokens_per_split)

    if (start < ctx) | (NUM_SPLITS == 1):
        seq64 = seq.to(tl.int64)
        heads = head0 + tl.arange(0, BLOCK_H)
        h_mask = heads < NUM_HEADS
        offs_l = tl.arange(0, BLOCK_L)
        offs_r = tl.arange(0, BLOCK_R)
        offs_n = tl.arange(0, BLOCK_N)
        l_mask = offs_l < LATENT
        r_mask = offs_r < ROPE
        ql_ptrs = q_latent_ptr + seq64 * ql_stride_b + heads[:, None] * ql_stride_h
        q_l = tl.load(ql_ptrs + offs_l[None, :], mask=h_mask[:, None] & l_mask[None, :], other=0.0)
        qr_ptrs = q_rope_ptr + seq64 * qr_stride_b + heads[:, None] * qr_stride_h
        q_r = tl.load(qr_ptrs + offs_r[None, :], mask=h_mask[:, None] & r_mask[None, :], other=0.0)

        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_L], dtype=tl.float32)
        bt_row = block_tables_ptr + seq64 * bt_stride_b
        for tile in range(start, end, BLOCK_N):
            pos = tile + offs_n
            valid = pos < end
            block = tl.load(bt_row + pos // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
            rows = block * cache_stride_block + (pos % PAGE_SIZE) * cache_stride_off
            # One load of the latent serves as every head's key (with the rope part) and value.
            k_l = tl.load(
                cache_ptr + rows[:, None] + offs_l[None, :],
                mask=valid[:, None] & l_mask[None, :],
                other=0.0,
            )
            k_r = tl.load(
                cache_ptr + rows[:, None] + LATENT + offs_r[None, :],
                mask=valid[:, None] & r_mask[None, :],
                other=0.0,
            )
            if IEEE_DOT:
                s = tl.dot(q_l, tl.trans(k_l), input_precision="ieee")
                s += tl.dot(q_r, tl.trans(k_r), input_precision="ieee")
            else:
                s = tl.dot(q_l, tl.trans(k_l))
                s += tl.dot(q_r, tl.trans(k_r))
            # Every tile holds at least one valid token, so m_new is finite.
            s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if IEEE_DOT:
                pv = tl.dot(p.to(k_l.dtype), k_l, input_precision="ieee")
            else:
                pv = tl.dot(p.to(k_l.dtype), k_l)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

        mine = h_mask[:, None] & l_mask[None, :]
        if NUM_SPLITS == 1:
            # context_len 0: no tile ran, l_i is 0, and the row is written as zeros.
            o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            o_ptrs = out_ptr + seq64 * out_stride_b + heads[:, None] * out_stride_h
            tl.store(o_ptrs + offs_l[None, :], o.to(out_ptr.dtype.element_ty), mask=mine)
        else:
            # Partials [B, NUM_HEADS, NUM_SPLITS(, LATENT)], as decode_attention's merge reads.
            row = (seq64 * NUM_HEADS + heads) * NUM_SPLITS + split
            tl.store(part_max_ptr + row, m_i, mask=h_mask)
            tl.store(part_sum_ptr + row, l_i, mask=h_mask)
            tl.store(part_acc_ptr + row[:, None] * LATENT + offs_l[None, :], acc, mask=mine)


def mla_decode_config(latent: int) -> dict[str, int]:
    """Launch settings by latent width. Untuned on hardware yet (benchmarks/mla_decode_bench.py
    sweeps them): 16 heads a program (the smallest tile a dot takes), 32 tokens a step, more
    warps once the [16, latent] fp32 accumulator and the [32, latent] key tile grow large."""
    stages = 2 if torch.version.hip is not None or latent > 256 else 3
    return {
        "block_n": 32,
        "block_h": 16,
        "num_warps": 8 if triton.next_power_of_2(latent) >= 512 else 4,
        "num_stages": stages,
    }


def mla_decode_attention(
    q_latent, q_rope, kv_cache, block_tables, context_lens, scale, out=None, *, num_splits=None,
    block_n=None, block_h=None, num_warps=None, num_stages=None,
):  # fmt: skip
    """See `atom_kernels.ops.mla_decode_attention`. The keyword-only arguments override the
    automatic launch choices (tests engage split-K on small shapes; the benchmark sweeps)."""
    batch, num_heads, latent = q_latent.shape
    rope = q_rope.shape[2]
    page_size = kv_cache.shape[1]
    if out is None:
        out = torch.empty_like(q_latent, memory_format=torch.contiguous_format)
    if batch == 0:
        return out
    config = mla_decode_config(latent)
    block_n = block_n or config["block_n"]
    block_h = block_h or config["block_h"]
    head_blocks = triton.cdiv(num_heads, block_h)
    if num_splits is None:
        num_splits = choose_num_splits(
            batch, head_blocks, block_tables.shape[1] * page_size, block_n,
            _multiprocessor_count(q_latent.device),
        )  # fmt: skip
    if num_splits > 1:
        dev = q_latent.device
        part_acc = torch.empty(
            (batch, num_heads, num_splits, latent), dtype=torch.float32, device=dev
        )
        part_max = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=dev)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # unused by the single-split path
    block_l = triton.next_power_of_2(latent)
    _mla_decode_split_kernel[(batch, head_blocks, num_splits)](
        q_latent, q_rope, kv_cache, block_tables, context_lens, out, part_acc, part_max,
        part_sum, scale * _LOG2E, q_latent.stride(0), q_latent.stride(1), q_rope.stride(0),
        q_rope.stride(1), kv_cache.stride(0), kv_cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, LATENT=latent, ROPE=rope, PAGE_SIZE=page_size,
        NUM_SPLITS=num_splits, BLOCK_H=max(16, block_h), BLOCK_N=block_n, BLOCK_L=block_l,
        BLOCK_R=max(16, triton.next_power_of_2(rope)), IEEE_DOT=q_latent.dtype == torch.float32,
        num_warps=num_warps or config["num_warps"], num_stages=num_stages or config["num_stages"],
        **pdl.options(q_latent.device),
    )  # fmt: skip
    if num_splits > 1:
        _decode_merge_kernel[(batch, num_heads)](
            context_lens, out, part_acc, part_max, part_sum, out, out.stride(0), out.stride(1),
            HEAD_DIM=latent, NUM_SPLITS=num_splits,
            BLOCK_S=min(_MERGE_SPLITS, triton.next_power_of_2(num_splits)), BLOCK_D=block_l,
            BLOCK_N=block_n, num_warps=1 if block_l <= 128 else 4, **pdl.options(q_latent.device),
        )  # fmt: skip
    return out


def mla_prefill_attention(q, k, v, q_lens, kv_lens, scale):
    """See `atom_kernels.ops.mla_prefill_attention`: torch SDPA, one call per chunk (lower-right
    causal where the chunk follows a prefix). V is zero-padded to the query's head dim when
    narrower, so the flash kernel (equal head dims) is eligible; the padding is cut off."""
    from torch.nn.attention.bias import causal_lower_right

    tokens, num_heads, qk_dim = q.shape
    v_dim = v.shape[2]
    if v_dim < qk_dim:
        v = torch.nn.functional.pad(v, (0, qk_dim - v_dim))
    out = torch.empty((tokens, num_heads, v_dim), dtype=q.dtype, device=q.device)
    q_at = kv_at = 0
    for q_len, kv_len in zip(q_lens, kv_lens, strict=True):
        if q_len:
            qi = q[q_at : q_at + q_len].transpose(0, 1).unsqueeze(0)
            ki = k[kv_at : kv_at + kv_len].transpose(0, 1).unsqueeze(0)
            vi = v[kv_at : kv_at + kv_len].transpose(0, 1).unsqueeze(0)
            if q_len == kv_len:
                o = torch.nn.functional.scaled_dot_product_attention(
                    qi, ki, vi, is_causal=True, scale=scale
                )
            else:
                o = torch.nn.functional.scaled_dot_product_attention(
                    qi, ki, vi, attn_mask=causal_lower_right(q_len, kv_len), scale=scale
                )
            out[q_at : q_at + q_len] = o[0, :, :, :v_dim].transpose(0, 1)
        q_at += q_len
        kv_at += kv_len
    return out

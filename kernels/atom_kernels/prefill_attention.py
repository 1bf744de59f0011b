"""Triton paged attention for prefill (and any mixed batch): packed variable-length query
chunks attending causally to their sequence's paged KV cache.

Grid: (query head, query tile, sequence). A program owns BLOCK_M consecutive queries of
one chunk for one head and sweeps the keys BLOCK_N at a time with `tl.dot` for QK^T and
PV and an online softmax. The sweep has two phases: keys before the tile's first query
position are visible to every row and need no mask; the remaining keys up to the tile's
last query position get the causal mask. Query tiles are launched longest-first (the
last tile of a chunk sees the most keys) so the tail of the launch is short work. Heads
of one KV group are neighbours in launch order, so their shared K/V tiles hit in L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


@triton.jit
def _attend_tile(
    q,
    acc,
    m_i,
    l_i,
    k_cache_ptr,
    v_cache_ptr,
    bt_row,
    head_off,
    cache_stride_block,
    cache_stride_off,
    tile,
    q_pos,
    kv_end,
    scale_log2,
    offs_n,
    offs_d,
    d_mask,
    CAUSAL: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    pos = tile + offs_n
    if CAUSAL:
        valid = pos < kv_end
        block = tl.load(bt_row + pos // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
        kv_mask = valid[:, None] & d_mask[None, :]
    else:
        block = tl.load(bt_row + pos // PAGE_SIZE).to(tl.int64)
        kv_mask = d_mask[None, :]
    rows = block * cache_stride_block + (pos % PAGE_SIZE) * cache_stride_off + head_off
    k = tl.load(k_cache_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    if IEEE_DOT:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * scale_log2
    if CAUSAL:
        s = tl.where(pos[None, :] <= q_pos[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A row whose keys so far are all masked keeps m = -inf; exp2(-inf - -inf) would be NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_cache_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    if IEEE_DOT:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    cu_seqlens_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    scale_log2,
    q_stride_t,
    q_stride_h,
    out_stride_t,
    out_stride_h,
    cache_stride_block,
    cache_stride_off,
    cache_stride_h,
    bt_stride_b,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    head = tl.program_id(0)
    m_block = tl.num_programs(1) - 1 - tl.program_id(1)  # longest tiles first
    seq = tl.program_id(2)

    q_start = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_start
    m0 = m_block * BLOCK_M
    if m0 < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        first_pos = seq_len - q_len  # absolute position of the chunk's first query

        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        m_mask = offs_m < q_len
        d_mask = offs_d < HEAD_DIM
        q_pos = first_pos + offs_m

        tokens = (q_start + offs_m).to(tl.int64)
        q_ptrs = q_ptr + tokens[:, None] * q_stride_t + head * q_stride_h + offs_d[None, :]
        q = tl.load(q_ptrs, mask=m_mask[:, None] & d_mask[None, :], other=0.0)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        bt_row = block_tables_ptr + seq.to(tl.int64) * bt_stride_b
        head_off = (head // GROUP).to(tl.int64) * cache_stride_h
        # Keys before first_pos + m0 precede every query of the tile: no mask needed.
        unmasked_end = ((first_pos + m0) // BLOCK_N) * BLOCK_N
        kv_end = first_pos + tl.minimum(q_len, m0 + BLOCK_M)  # last query's position + 1
        for tile in range(0, unmasked_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                q,
                acc,
                m_i,
                l_i,
                k_cache_ptr,
                v_cache_ptr,
                bt_row,
                head_off,
                cache_stride_block,
                cache_stride_off,
                tile,
                q_pos,
                kv_end,
                scale_log2,
                offs_n,
                offs_d,
                d_mask,
                False,
                PAGE_SIZE,
                IEEE_DOT,
            )
        for tile in range(unmasked_end, kv_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                q,
                acc,
                m_i,
                l_i,
                k_cache_ptr,
                v_cache_ptr,
                bt_row,
                head_off,
                cache_stride_block,
                cache_stride_off,
                tile,
                q_pos,
                kv_end,
                scale_log2,
                offs_n,
                offs_d,
                d_mask,
                True,
                PAGE_SIZE,
                IEEE_DOT,
            )

        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptrs = out_ptr + tokens[:, None] * out_stride_t + head * out_stride_h + offs_d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def prefill_config(head_dim: int) -> dict[str, int]:
    """Tile sizes and launch settings by head_dim and vendor.

    head_dim 128 on an H200 (bf16, one 8k prompt, `kernels_bench.py --sweep`): 128x64
    tiles, 4 warps, 3 stages ran at ~370 TFLOP/s; 8 warps ~300, 128x128 ~350, 64x64 ~330.
    head_dim 256 halves both tiles to keep K, V and the accumulator within shared memory
    and registers.
    """
    block_d = triton.next_power_of_2(head_dim)
    is_hip = torch.version.hip is not None
    if block_d <= 128:
        if is_hip:  # MI300: 64-wide wavefronts; its pipeliner wants 2 stages
            return {"block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 2}
        return {"block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 3}
    return {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 2}


def paged_attention_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_seqlen_q: int,
    out: torch.Tensor | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """See `atom_kernels.ops.paged_attention_prefill`. The keyword-only arguments override
    the tuned launch settings (tests use small tiles to cross tile boundaries on small
    shapes; the benchmark sweeps them)."""
    _, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("q and the caches need a contiguous head_dim; caches share strides")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.stride(2) != 1:
        raise ValueError(f"out {tuple(out.shape)} must match q {tuple(q.shape)}")
    batch = seq_lens.shape[0]
    if batch == 0 or max_seqlen_q <= 0 or q.shape[0] == 0:
        return out

    config = prefill_config(head_dim)
    block_m = block_m or config["block_m"]
    block_n = block_n or config["block_n"]
    grid = (num_heads, triton.cdiv(max_seqlen_q, block_m), batch)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        cu_seqlens_q,
        seq_lens,
        block_tables,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(head_dim),
        IEEE_DOT=q.dtype == torch.float32,
        num_warps=num_warps or config["num_warps"],
        num_stages=num_stages or config["num_stages"],
    )
    return out

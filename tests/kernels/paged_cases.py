"""Builders for paged-KV test inputs and an independent naive attention to pin the references.

The naive attention walks the block table one token at a time and computes a dense float64
softmax per head, sharing no code with `atom_kernels.reference`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class PagedCase:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [B, max_blocks_per_seq]
    seq_lens: list[int]


def make_paged_case(
    seq_lens: list[int],
    *,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    generator: torch.Generator,
    extra_blocks: int = 3,
    pad_value: int = -1,
) -> PagedCase:
    """A cache holding `seq_lens[b]` random tokens per sequence in shuffled blocks.

    Every slot no sequence owns (whole spare blocks and the tails of last blocks) holds NaN,
    so a kernel that reads past its masks produces NaN instead of a plausible number.
    Block-table entries past the used blocks hold `pad_value`.
    """
    blocks_needed = [math.ceil(n / block_size) for n in seq_lens]
    max_blocks = max(1, max(blocks_needed, default=1) + 1)  # one padded entry at least
    num_blocks = sum(blocks_needed) + extra_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    order = torch.randperm(num_blocks, generator=generator).tolist()
    block_tables = torch.full((len(seq_lens), max_blocks), pad_value, dtype=torch.int32)
    for b, (n, nb) in enumerate(zip(seq_lens, blocks_needed, strict=True)):
        mine = [order.pop() for _ in range(nb)]
        block_tables[b, :nb] = torch.tensor(mine, dtype=torch.int32)
        for i, blk in enumerate(mine):
            used = min(block_size, n - i * block_size)
            rows = (used, num_kv_heads, head_dim)
            k_cache[blk, :used] = torch.randn(rows, generator=generator).to(dtype)
            v_cache[blk, :used] = torch.randn(rows, generator=generator).to(dtype)
    return PagedCase(k_cache, v_cache, block_tables, list(seq_lens))


def naive_attention(
    q: torch.Tensor,
    case: PagedCase,
    seq: int,
    first_position: int,
    scale: float,
) -> torch.Tensor:
    """float64 `[q_len, num_heads, head_dim]` for queries of sequence `seq` starting at
    absolute position `first_position`, by per-token gather and an explicit causal mask."""
    q_len, num_heads, head_dim = q.shape
    num_kv_heads = case.k_cache.shape[2]
    block_size = case.k_cache.shape[1]
    n = case.seq_lens[seq]
    keys, values = [], []
    for pos in range(n):
        blk = int(case.block_tables[seq, pos // block_size])
        keys.append(case.k_cache[blk, pos % block_size].double())
        values.append(case.v_cache[blk, pos % block_size].double())
    out = torch.zeros(q_len, num_heads, head_dim, dtype=torch.float64)
    if n == 0:
        return out
    k = torch.stack(keys)  # [n, kv_heads, head_dim]
    v = torch.stack(values)
    group = num_heads // num_kv_heads
    for h in range(num_heads):
        kv = h // group
        scores = q[:, h].double() @ k[:, kv].T * scale  # [q_len, n]
        for i in range(q_len):
            visible = first_position + i + 1
            row = scores[i, :visible]
            weights = torch.exp(row - row.max())
            out[i, h] = (weights / weights.sum()) @ v[:visible, kv]
    return out

"""Attention over the paged KV cache: the one small interface between models and kernels.

Writes this step's K/V into the cache at the slot mapping, then attends: the decode kernel when
every sequence runs one token, the variable-length prefill kernel otherwise (a chunk of length one
is a decode there too, so mixed batches are correct).
"""

from __future__ import annotations

import torch
from torch import nn

from atom_kernels import ops
from atom_runtime.forward_context import get_attention_metadata


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        # Bound by the model runner once the cache is allocated.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim]. Returns [T, heads*dim]."""
        meta = get_attention_metadata()
        if self.k_cache.numel() == 0:
            raise RuntimeError("KV cache not allocated: the model runner binds it before forward")
        ops.store_kvcache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        if meta.decode_only:
            out = ops.paged_attention_decode(
                q, self.k_cache, self.v_cache, meta.block_tables, meta.seq_lens, self.scale
            )
        else:
            out = ops.paged_attention_prefill(
                q,
                self.k_cache,
                self.v_cache,
                meta.cu_seqlens_q,
                meta.seq_lens,
                meta.block_tables,
                self.scale,
                meta.max_seqlen_q,
            )
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

"""Attention over the paged KV cache: the one small interface between models and kernels.

`prepare` turns the fused qkv projection into attention inputs in one kernel (QK-norm when the
model has it, rotary, this step's K/V written into the cache at the slot mapping); `forward`
attends: the decode kernel when every sequence runs one token; when every chunk starts at
position 0 (fresh prompts), `dense_prefill` is on (set by the model runner at start-up where
torch's attention kernels run, with ATOM_DENSE_PREFILL=1) and the chunks are of a kind the
dense kernels win on (`varlen_attention.takes_dense_path`), dense attention over the step's own
q/k/v; otherwise the paged variable-length prefill kernel (a chunk of length one is a decode
there too, so mixed batches are correct).

Sliding-window layers (`sliding_window` > 0: Mistral, Mixtral, GPT-OSS's every other layer)
attend over their last `sliding_window` positions; where the engine frees the blocks a window
has left behind, they write and read through the step's window block tables
(`AttentionMetadata.window`). Attention sinks (GPT-OSS) are a learned per-head logit in each
softmax's denominator (`sinks`, a parameter of the layer).

The cache is in the model's dtype or FP8 (`--kv-cache-dtype fp8`, `use_kv_cache_dtype`): every
kernel that writes or reads it takes the layer's per-tensor `k_scale` / `v_scale` (an FP8 cache
holds K / k_scale), 1.0 or the checkpoint's. The dense path of fresh prompts reads no cache: it
attends over the projection's own K and V, in the model's dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from atom_kernels import ops, varlen_attention
from atom_kernels.fp8_formats import is_fp8
from atom_runtime.layers.cache_spec import KVCacheSpec, paged_kv_spec
from atom_runtime.layers.forward_context import AttentionMetadata, get_attention_metadata
from atom_runtime.layers.norm import RMSNorm
from atom_runtime.layers.weights import copy_weight
from atom_runtime.system.distributed import tp_rank


class PagedAttention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        q_gate: bool = False,
        sliding_window: int | None = None,
        sinks: bool = False,
    ) -> None:
        super().__init__()
        self.sliding_window = sliding_window or 0
        # This rank's heads' sink logits (fp32; the checkpoint holds every head's).
        if sinks:
            self.sinks = nn.Parameter(torch.empty(num_heads), requires_grad=False)
            self.sinks.weight_loader = self._load_sinks
            self.sinks.keep_fp32 = True  # added to fp32 softmax sums
        else:
            self.sinks = None
        # Gated attention: each q head is followed by its output gate in the qkv projection.
        self.q_gate = q_gate
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim, self.scale = head_dim, scale
        # Bound by the model runner once the cache is allocated.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        # The cache's dtype (None: the model's) and, for an FP8 cache, its dequantization scales
        # (floats: launch constants, fixed once loaded). The checkpoint's k/v scales, when it
        # has them, are kept here as it loads (models/fp8_loading.py).
        self.kv_cache_dtype: torch.dtype | None = None
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.checkpoint_kv_scales: dict[str, float] = {}
        # Set by the model runner (where `varlen_attention.supported` on its device, with
        # ATOM_DENSE_PREFILL=1): fresh prompts then may attend densely. False on CPU (the paged
        # path is the only one there).
        self.dense_prefill = False

    def cache_spec(self) -> KVCacheSpec:
        """K and V of this rank's KV heads, one row per token each."""
        return paged_kv_spec(self.num_kv_heads, self.head_dim, self.kv_cache_dtype)

    def use_kv_cache_dtype(self, dtype: torch.dtype) -> None:
        """Keep the cache in `dtype`; an FP8 one with the checkpoint's k/v scales (1.0 where it
        has none), moved to the format's own scale (e4m3fnuz's values are half e4m3fn's)."""
        self.kv_cache_dtype = dtype
        if not is_fp8(dtype):
            self.k_scale = self.v_scale = 1.0
            return
        k = self.checkpoint_kv_scales.get("k_scale", 1.0)
        v = self.checkpoint_kv_scales.get("v_scale", 1.0)
        factor = 2.0 if dtype == torch.float8_e4m3fnuz and self.checkpoint_kv_scales else 1.0
        self.k_scale, self.v_scale = k * factor, v * factor

    def kv_scales(self) -> dict[str, float]:
        """The `k_scale` / `v_scale` keywords of every op that touches this layer's cache."""
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}

    def bind_cache(self, tensors: list[torch.Tensor]) -> None:
        """Take the cache tensors allocated from `cache_spec` (empty ones release them)."""
        self.k_cache, self.v_cache = tensors

    def cache_tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.k_cache, self.v_cache)

    def prepare(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        q_norm_weight: torch.Tensor | None = None,
        k_norm_weight: torch.Tensor | None = None,
        eps: float = 1e-6,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """From the fused qkv projection: QK-norm (optional), rotary (over the cos_sin_cache's
        rotary_dim), and this step's K/V into the cache, in one pass. Returns (q, k, v) as [T,
        heads, head_dim] views into qkv, normed and rotated (q strided past the gates with
        `q_gate`): `forward` takes k and v for the dense path of fresh prompts."""
        self._check_bound()
        meta = self.metadata()
        ops.qk_norm_rope_store_(
            qkv,
            positions,
            cos_sin_cache,
            q_norm_weight,
            k_norm_weight,
            eps,
            self.k_cache,
            self.v_cache,
            meta.slot_mapping,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.q_gate,
            **self.kv_scales(),
        )
        return varlen_attention.qkv_views(
            qkv, self.num_heads, self.num_kv_heads, self.head_dim, self.q_gate
        )

    def prepare_one_row(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        q_norm_weight: torch.Tensor | None = None,
        k_norm_weight: torch.Tensor | None = None,
        *,
        eps: float = 1e-6,
        norm: RMSNorm | None = None,
        residual: torch.Tensor | None = None,
        **fp8,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`prepare` of one token fused with the qkv projection that precedes it: one GEMV
        launch projects x, norms q and k heads (QK-norm, when its weights are given), rotates
        them, and stores k and v in the cache; with `norm`, the layer's input RMSNorm (after
        adding `residual`, when given) runs in the same launch. Returns (q as [1, num_heads,
        head_dim], x + residual; x itself without a residual). `fp8`: an FP8 weight's keywords
        (`LinearBase.gemv_scales`)."""
        self._check_bound()
        rope = (
            positions, cos_sin_cache, self.k_cache, self.v_cache, self.metadata().slot_mapping,
            self.num_heads, self.num_kv_heads, self.head_dim, q_norm_weight, k_norm_weight, eps,
        )  # fmt: skip
        if norm is None:
            qkv = ops.linear_rope_store_small_m(x, weight, bias, *rope, **fp8, **self.kv_scales())
            return self._one_row_q(qkv), x
        qkv, residual = ops.rms_norm_linear_rope_store_small_m(
            x, residual, norm.weight, norm.eps, weight, bias, *rope, **fp8, **self.kv_scales()
        )
        return self._one_row_q(qkv), residual

    def metadata(self) -> AttentionMetadata:
        """The step's attention metadata for this layer: a sliding-window layer's own slot
        mapping and block tables when the engine keeps a window's blocks apart."""
        meta = get_attention_metadata()
        if self.sliding_window and meta.window is not None:
            return meta.window
        return meta

    def _load_sinks(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        n = param.data.shape[0]
        copy_weight(param.data, loaded.narrow(0, tp_rank() * n, n))

    def _one_row_q(self, qkv: torch.Tensor) -> torch.Tensor:
        return qkv[:, : self.num_heads * self.head_dim].view(1, self.num_heads, self.head_dim)

    def _check_bound(self) -> None:
        if self.k_cache.numel() == 0:
            raise RuntimeError("KV cache not allocated: the model runner binds it before forward")

    def forward(
        self, q: torch.Tensor, k: torch.Tensor | None = None, v: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Attention of q ([T, num_heads, head_dim]) over the cache, whose K/V for this step
        `prepare` already stored. k, v: this step's own keys and values ([T, num_kv_heads,
        head_dim], from `prepare`); with them, a step of fresh prompts attends over them alone,
        densely, when `dense_prefill` is on and `varlen_attention.takes_dense_path` says the dense
        kernels win on its chunks. Returns [T, num_heads * head_dim]."""
        meta = self.metadata()
        window, sinks = self.sliding_window, self.sinks
        if meta.decode_only:
            out = ops.paged_attention_decode(
                q, self.k_cache, self.v_cache, meta.block_tables, meta.seq_lens, self.scale,
                sliding_window=window, sinks=sinks, **self.kv_scales(),
            )  # fmt: skip
        elif (
            self.dense_prefill
            and k is not None
            and meta.fresh_chunks is not None
            and varlen_attention.takes_dense_path(meta.fresh_chunks, self.num_heads, self.head_dim)
        ):
            out = ops.varlen_causal_attention(
                q, k, v, meta.cu_seqlens_q, meta.fresh_chunks, self.scale, meta.max_seqlen_q,
                meta.dense_rows,
            )  # fmt: skip
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
                sliding_window=window,
                sinks=sinks,
                **self.kv_scales(),
            )
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

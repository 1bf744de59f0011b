"""Multi-head latent attention (DeepSeek-V2/V3) over a latent KV cache.

The cache keeps one row a token a layer, shared by every head: the normalized KV latent
(kv_lora_rank channels) and the rotated rope key (qk_rope_head_dim), `[num_blocks, block_size,
kv_lora_rank + rope]` (`cache_spec`). Per-head keys and values are the latent times kv_b_proj's
rows: W_UK (each head's no-rope key rows) and W_UV (its value rows). Two ways to attend:

- absorbed: q_nope @ W_UK puts the query in the latent space, every head attends over the
  latent rows themselves (multi-query attention, head dim latent + rope, the latent part as
  the value), and the output leaves through W_UV. Per query and head it costs
  `latent * (nope + v)` for the two products plus `context * (2 * latent + rope)` for attention,
  and it reads nothing but the latent rows: every decode row takes it
  (`ops.mla_decode_attention`, CUDA-graph capturable), and so does any chunk too short for the
  other way to pay.
- up-projected: the chunk's whole context (cached prefix, earlier chunks, itself) is expanded
  to per-head K/V once (`context * latent * (nope + v)` per head) and attended as ordinary
  attention (`context * (nope + rope + v)` per query). For a chunk of q_len queries over
  context keys this wins when `upprojection_pays`: with DeepSeek-V3's dims (latent 512, nope
  128, rope 64, v 128) from about 171 query tokens on, whatever the context length. Long
  prompt chunks take it on eager steps, where the host knows the chunk lengths.

A chunk that attends absorbed is a set of decode rows: query i of a chunk over a prefix of p
tokens sees p + i + 1 cache rows, so the decode kernel runs it with one row per token (its
sequence's block table, its own context length). On captured steps those rows are computed
on the device from cu_seqlens_q and seq_lens (no host sync).

Tensor parallelism splits the heads (q_b_proj, kv_b_proj, o_proj); the latent is one row a
token, not per head, so every rank computes and holds the whole latent cache (replicated).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from atom_kernels import ops
from atom_runtime.layers.cache_spec import KVCacheSpec, latent_spec
from atom_runtime.layers.forward_context import AttentionMetadata, get_attention_metadata
from atom_runtime.layers.linear import LinearBase
from atom_runtime.layers.norm import RMSNorm
from atom_runtime.system.device import to_device_many

PREFILL_PATHS = ("auto", "absorbed", "upprojected")


def upprojection_pays(q_len: int, kv_len: int, latent: int, nope: int, v_dim: int) -> bool:
    """Whether a chunk of q_len queries over kv_len keys costs no more multiply-adds per head
    up-projected than absorbed (the rope channels cost the same both ways)."""
    absorbed = q_len * latent * (nope + v_dim) + q_len * kv_len * 2 * latent
    upprojected = kv_len * latent * (nope + v_dim) + q_len * kv_len * (nope + v_dim)
    return upprojected <= absorbed


@dataclass
class _ChunkPlan:
    """A step's split between the two paths (host-planned, eager steps only)."""

    absorbed_index: torch.Tensor  # int64 [Ta]: tokens that attend absorbed
    absorbed_tables: torch.Tensor  # int32 [Ta, W]: each one's block table row
    absorbed_lens: torch.Tensor  # int32 [Ta]: each one's context length
    upprojected_index: torch.Tensor  # int64 [Tu]: tokens of up-projected chunks
    context_slots: torch.Tensor  # int64 [S]: those chunks' context rows, chunk after chunk
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]


class LatentAttention(nn.Module):
    """The attention of one MLA layer from its projections' outputs on: cache write, attention,
    [T, heads * v_head_dim] for o_proj. Holds this rank's heads and the latent cache."""

    def __init__(
        self,
        num_heads: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        scale: float,
        rope_is_neox: bool = False,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.latent, self.nope, self.rope = kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim
        self.v_dim = v_head_dim
        self.scale = scale
        self.rope_is_neox = rope_is_neox
        # The multi-query view the model runner reads: one latent "head" of latent + rope.
        self.num_kv_heads = 1
        self.head_dim = kv_lora_rank + qk_rope_head_dim
        self.kv_cache = torch.empty(0)  # bound by the model runner
        # "auto": long chunks up-project where `upprojection_pays`; "absorbed"/"upprojected"
        # force one path for every prompt chunk of an eager step (tests, benchmarks).
        self.prefill_path = "auto"
        # Context rows one step may up-project at most (set by the model runner to the step's
        # token budget: the profiling forward's fresh prompt measured that peak); chunks past
        # it attend absorbed. 0: no limit.
        self.max_upprojected_rows = 0

    # -- the cache -------------------------------------------------------------------------------

    def cache_spec(self) -> KVCacheSpec:
        return latent_spec(self.latent, self.rope)

    def bind_cache(self, tensors: list[torch.Tensor]) -> None:
        (self.kv_cache,) = tensors

    def cache_tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.kv_cache,)

    # -- attention -------------------------------------------------------------------------------

    def forward(
        self,
        q: torch.Tensor,
        kv_a: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        kv_norm: RMSNorm,
        kv_b_proj: LinearBase,
    ) -> torch.Tensor:
        """q: [T, heads, nope + rope] (q_b_proj's output); kv_a: [T, latent + rope] (kv_a_proj's,
        before its norm). Rotates q's rope channels, stores this step's latent rows, attends;
        returns [T, heads * v_head_dim]."""
        if self.kv_cache.numel() == 0:
            raise RuntimeError("latent cache not allocated: the model runner binds it first")
        meta = get_attention_metadata()
        nope = self.nope
        ops.mla_rope_store_(
            q[..., nope:], kv_a, positions, cos_sin_cache, kv_norm.weight, kv_norm.eps,
            self.kv_cache, meta.slot_mapping, self.rope_is_neox,
        )  # fmt: skip
        # W_UK [H, nope, latent] and W_UV [H, v, latent]: views of kv_b_proj's rows, per head.
        w = kv_b_proj.dense_weight().view(self.num_heads, nope + self.v_dim, self.latent)
        if meta.decode_only:
            out = self._absorbed(q, w, meta.block_tables, meta.seq_lens)
        else:
            out = self._prefill(q, w, kv_b_proj, meta)
        return out.reshape(q.shape[0], self.num_heads * self.v_dim)

    def _absorbed(
        self, q: torch.Tensor, w: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor
    ) -> torch.Tensor:
        """[n, heads, v] for query rows q ([n, heads, nope + rope]) attending absorbed."""
        nope = self.nope
        q_latent = torch.bmm(q[..., :nope].transpose(0, 1), w[:, :nope])  # [H, n, latent]
        o = ops.mla_decode_attention(
            q_latent.transpose(0, 1), q[..., nope:], self.kv_cache, tables, lens, self.scale
        )  # [n, H, latent]
        return torch.bmm(o.transpose(0, 1), w[:, nope:].transpose(1, 2)).transpose(0, 1)

    def _upprojected(
        self, q: torch.Tensor, kv_b_proj: LinearBase, plan: _ChunkPlan
    ) -> torch.Tensor:
        """[Tu, heads, v] for the up-projected chunks' queries: their contexts' latents
        expanded to per-head K/V through kv_b_proj, then causal attention."""
        latent, nope = self.latent, self.nope
        rows = self.kv_cache.view(-1, self.head_dim).index_select(0, plan.context_slots)
        kv = kv_b_proj(rows[:, :latent]).view(rows.shape[0], self.num_heads, nope + self.v_dim)
        k_rope = rows[:, None, latent:].expand(-1, self.num_heads, -1)
        k = torch.cat([kv[..., :nope], k_rope], dim=-1)
        return ops.mla_prefill_attention(
            q, k, kv[..., nope:], plan.q_lens, plan.kv_lens, self.scale
        )

    def _prefill(
        self, q: torch.Tensor, w: torch.Tensor, kv_b_proj: LinearBase, meta: AttentionMetadata
    ) -> torch.Tensor:
        plan = self._plan(meta)
        if plan is None:  # every token absorbed, rows from the device metadata
            key = ("mla_token_rows", q.shape[0])
            if key not in meta.derived:
                meta.derived[key] = token_rows(meta, q.shape[0])
            return self._absorbed(q, w, *meta.derived[key])
        out = q.new_empty(q.shape[0], self.num_heads, self.v_dim)
        if plan.absorbed_index.numel():
            sub = q.index_select(0, plan.absorbed_index)
            absorbed = self._absorbed(sub, w, plan.absorbed_tables, plan.absorbed_lens)
            out.index_copy_(0, plan.absorbed_index, absorbed)
        sub = q.index_select(0, plan.upprojected_index)
        out.index_copy_(0, plan.upprojected_index, self._upprojected(sub, kv_b_proj, plan))
        return out

    def _plan(self, meta: AttentionMetadata) -> _ChunkPlan | None:
        """This step's chunk plan, made by the first MLA layer and kept for the others; None
        when nothing up-projects (or the step carries no host arrays: a captured graph)."""
        if meta.host_cu_seqlens_q is None or self.prefill_path == "absorbed":
            return None
        key = ("mla_plan", self.latent, self.nope, self.v_dim, self.prefill_path)
        if key not in meta.derived:
            meta.derived[key] = self._make_plan(meta)
        return meta.derived[key]

    def _make_plan(self, meta: AttentionMetadata) -> _ChunkPlan | None:
        cu, lens = meta.host_cu_seqlens_q, meta.host_seq_lens
        tables, block_size = meta.host_block_tables, self.kv_cache.shape[1]
        budget = self.max_upprojected_rows or np.iinfo(np.int64).max
        up: list[int] = []
        for b, (q_len, kv_len) in enumerate(zip(np.diff(cu).tolist(), lens.tolist(), strict=True)):
            pays = self.prefill_path == "upprojected" or upprojection_pays(
                q_len, kv_len, self.latent, self.nope, self.v_dim
            )
            if q_len and pays and kv_len <= budget:
                up.append(b)
                budget -= kv_len
        if not up:
            return None
        absorbed = np.ones(int(cu[-1]), dtype=bool)
        up_tokens, slots = [], []
        for b in up:
            absorbed[cu[b] : cu[b + 1]] = False
            up_tokens.append(np.arange(cu[b], cu[b + 1]))
            pos = np.arange(lens[b])
            slots.append(
                tables[b, pos // block_size].astype(np.int64) * block_size + pos % block_size
            )
        a_index = np.flatnonzero(absorbed)
        a_seq = np.searchsorted(cu[1:], a_index, side="right")
        a_lens = (lens[a_seq] - (cu[a_seq + 1] - 1 - a_index)).astype(np.int32)
        arrays = [
            a_index.astype(np.int64), np.ascontiguousarray(tables[a_seq]), a_lens,
            np.concatenate(up_tokens).astype(np.int64), np.concatenate(slots),
        ]  # fmt: skip
        a_idx, a_tables, a_lens_d, u_idx, ctx_slots = to_device_many(arrays, self.kv_cache.device)
        return _ChunkPlan(
            a_idx, a_tables, a_lens_d, u_idx, ctx_slots,
            q_lens=tuple(int(cu[b + 1] - cu[b]) for b in up),
            kv_lens=tuple(int(lens[b]) for b in up),
        )  # fmt: skip


def token_rows(meta: AttentionMetadata, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token of a non-decode step as a decode row: its sequence's block table row and its
    context length (position + 1; 0 for padding tokens past the last chunk). Device ops only,
    so a captured graph computes them on replay."""
    cu = meta.cu_seqlens_q
    num_seqs = cu.shape[0] - 1
    tok = torch.arange(tokens, dtype=torch.int32, device=cu.device)
    seq = torch.searchsorted(cu[1:], tok, right=True)
    real = seq < num_seqs
    seq = seq.clamp(max=num_seqs - 1)
    lens = meta.seq_lens[seq] - (cu[seq + 1] - 1 - tok)
    lens = torch.where(real, lens, torch.zeros_like(lens)).to(torch.int32)
    return meta.block_tables.index_select(0, seq), lens

"""Hybrid decoders: Qwen3.5 (dense), Qwen3.5-MoE and Qwen3-Next (sparse MoE + shared expert).

Most layers are Gated DeltaNet (GDN) linear attention, whose per-request state (a short causal
conv window and a [heads, k_dim, v_dim] recurrent matrix) lives in the state slot pool
(`atom_runtime.state`); every `full_attention_interval`-th layer (or as `layer_types` says) is
gated full attention over the paged KV cache: q_proj yields a query and an output gate per head,
q/k get a per-head RMSNorm, rotary covers only the first `partial_rotary_factor` of each head,
and the attention output is multiplied by sigmoid(gate) before o_proj. At batch 1 a step costs
its launch count (docs/hybrid-models.md), so a decode batch runs each GDN layer between its
projections as one op (`ops.gated_delta_net_decode_`), and every batch runs the attention
layer's norms, partial rotary and cache store as one (`qk_norm_rope_store_` with `q_gate`).

The three architectures differ only in how their checkpoints store things:
- Qwen3.5 projects q/k/v, z, b and a with separate matrices; Qwen3-Next interleaves q/k/v/z per
  key-head group in `in_proj_qkvz` (and b/a in `in_proj_ba`). We de-interleave at load time, so
  one layer serves both.
- Every decoder RMSNorm (not the gated one inside GDN) scales by (1 + weight): the loader adds
  the 1 once, so the ordinary RMSNorm kernels run.
- MoE experts come either fused (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj`
  [E, H, I]) or one tensor per expert (`experts.{e}.gate_proj.weight`, ...).
- The multimodal Qwen3.5 checkpoints put the language model under `model.language_model.` and
  carry a vision tower and an MTP head, which a text-only engine skips.

Tensor parallelism splits attention heads, GDN key/value heads (the state follows its heads)
and each expert's intermediate dimension; the router, norms and the shared expert gate are
replicated (plain `LinearBase`).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from atom_kernels import ops
from atom_runtime.layers.attention import PagedAttention
from atom_runtime.layers.forward_context import get_state_metadata
from atom_runtime.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    _divide,
)
from atom_runtime.layers.moe import DenseMLP, SparseMoE, load_routed_expert
from atom_runtime.layers.norm import RMSNorm
from atom_runtime.layers.rotary import RotaryEmbedding
from atom_runtime.layers.weights import copy_weight
from atom_runtime.models.causal_lm import CausalLM, DecoderTrunk
from atom_runtime.models.config import ModelConfig
from atom_runtime.system.distributed import tp_rank, tp_size


class OffsetRMSNorm(RMSNorm):
    """Qwen3.5/Next's RMSNorm scales by (1 + weight); the checkpoint's weight gets its 1 added at
    load time so the plain RMSNorm kernels apply. A fresh (dummy) model holds ones: the
    checkpoint's zeros."""

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        copy_weight(param.data, loaded)
        param.data.add_(1.0)


def _narrow_rank(param: nn.Parameter, loaded, dim: int = 0) -> None:
    n = param.data.shape[dim]
    copy_weight(param.data, loaded.narrow(dim, tp_rank() * n, n))


class GatedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hd = cfg.head_dim
        self.head_dim = hd
        # q_proj holds [query; gate] per head: a "q" shard of 2 * heads pseudo-heads keeps each
        # head's pair on one rank.
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, hd, 2 * cfg.num_attention_heads, cfg.num_key_value_heads,
            bias=cfg.attention_bias,
        )  # fmt: skip
        self.qkv_proj.norm_before = True  # the decoder layer calls it with its input norm
        self.qkv_proj.pads_for_attention = True  # fresh prompts' dense attention pads it
        self.num_heads = _divide(cfg.num_attention_heads, tp_size(), "attention heads")
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * hd, cfg.hidden_size, bias=cfg.attention_bias
        )
        self.q_norm = OffsetRMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(hd, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(
            cfg.rotary_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, hd, hd**-0.5, q_gate=True)

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """Attention from the qkv projection on: norms, rotary, cache, gate, o_proj."""
        t, hd, nh = qkv.shape[0], self.head_dim, self.num_heads
        # One launch: q/k norms, partial rotary, k/v into the cache; q stays in qkv beside its gate.
        q, k, v = self.attn.prepare(
            qkv, positions, self.rotary.cos_sin_cache, self.q_norm.weight, self.k_norm.weight,
            self.q_norm.eps,
        )  # fmt: skip
        gate = qkv[:, : nh * 2 * hd].view(t, nh, 2 * hd)[..., hd:]
        out = ops.sigmoid_gate_mul(self.attn(q, k, v).view(t, nh, hd), gate)
        return self.o_proj(out.view(t, nh * hd))


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet token mixer. Its conv and recurrent state tensors ([slots, ...], every
    slot of the pool) are bound by the model runner; the step's state metadata says which slot
    each sequence of the batch reads and writes, and whether it starts from zero."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        tp = tp_size()
        nk_all, nv_all = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.num_k_heads = _divide(nk_all, tp, "linear_num_key_heads")
        self.num_v_heads = nv_all // tp  # a multiple of the key heads, so it divides too
        self.k_dim, self.v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_size = self.num_k_heads * self.k_dim  # per rank
        self.value_size = self.num_v_heads * self.v_dim
        self.conv_dim = 2 * self.key_size + self.value_size
        self.conv_width = cfg.linear_conv_kernel_dim
        self.layout = cfg.gdn_projection_layout
        self.nk_all, self.nv_all = nk_all, nv_all
        key_all, value_all = nk_all * self.k_dim, nv_all * self.v_dim
        # One projection for [q | k | v | z | b | a]: shards 0..5.
        self.in_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [key_all, key_all, value_all, value_all, nv_all, nv_all]
        )
        self.in_proj.norm_before = True  # the decoder layer calls it with its input norm
        self.in_proj.loads_fp8_checkpoint = False  # its loader reorders rows: no block scales
        self.conv_weight = nn.Parameter(
            torch.empty(self.conv_dim, self.conv_width), requires_grad=False
        )
        self.conv_weight.weight_loader = self._load_conv
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.A_log.weight_loader = _narrow_rank
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.dt_bias.weight_loader = _narrow_rank
        self.norm = RMSNorm(self.v_dim, cfg.rms_norm_eps)  # gated; plain weight, not 1 + w
        self.out_proj = RowParallelLinear(value_all, cfg.hidden_size)
        # Bound by the model runner: [slots, conv_dim, width - 1] and [slots, Hv, Dk, Dv].
        self.conv_state = torch.empty(0)
        self.ssm_state = torch.empty(0)

    def state_shapes(self) -> list[tuple[int, ...]]:
        """Per-slot shapes of (conv state, recurrent state) on this rank."""
        return [
            (self.conv_dim, self.conv_width - 1),
            (self.num_v_heads, self.k_dim, self.v_dim),
        ]

    def _load_conv(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        """conv1d.weight [2K + V, 1, W]: this rank's rows of each of the q, k, v blocks (only
        those rows are read)."""
        key_all, r = self.nk_all * self.k_dim, tp_rank()
        parts = [
            loaded.narrow(0, r * self.key_size, self.key_size),
            loaded.narrow(0, key_all + r * self.key_size, self.key_size),
            loaded.narrow(0, 2 * key_all + r * self.value_size, self.value_size),
        ]
        copy_weight(param.data, torch.cat([p.reshape(p.shape[0], -1) for p in parts]))

    def _copy_shard(self, shard: int, rows: torch.Tensor) -> None:
        """This rank's rows of in_proj shard `shard` (0..5: q, k, v, z, b, a)."""
        sizes = [self.key_size, self.key_size, self.value_size, self.value_size]
        sizes += [self.num_v_heads, self.num_v_heads]
        copy_weight(self.in_proj.weight.data.narrow(0, sum(sizes[:shard]), sizes[shard]), rows)

    def load_projection(self, kind: str, loaded) -> None:
        """Copy a checkpoint projection into the fused in_proj, reading only this rank's rows
        (a rank owns a contiguous run of key heads and of the value heads they serve)."""
        r, ks, vs, nv = tp_rank(), self.key_size, self.value_size, self.num_v_heads
        key_all = self.nk_all * self.k_dim
        if kind == "in_proj_qkv":  # [q (all heads) | k | v]
            self._copy_shard(0, loaded.narrow(0, r * ks, ks))
            self._copy_shard(1, loaded.narrow(0, key_all + r * ks, ks))
            self._copy_shard(2, loaded.narrow(0, 2 * key_all + r * vs, vs))
        elif kind == "in_proj_z":
            self._copy_shard(3, loaded.narrow(0, r * vs, vs))
        elif kind in ("in_proj_b", "in_proj_a"):
            self._copy_shard(4 if kind == "in_proj_b" else 5, loaded.narrow(0, r * nv, nv))
        elif kind == "in_proj_qkvz":
            # Per key head: [q (Dk), k (Dk), v (g * Dv), z (g * Dv)], g = Hv / Hk.
            g = self.nv_all // self.nk_all
            width = 2 * self.k_dim + 2 * g * self.v_dim
            mine = loaded.narrow(0, r * self.num_k_heads * width, self.num_k_heads * width)
            mine = mine.reshape(self.num_k_heads, width, -1)
            parts = mine.split([self.k_dim, self.k_dim, g * self.v_dim, g * self.v_dim], 1)
            for shard, part in enumerate(parts):
                self._copy_shard(shard, part.reshape(-1, mine.shape[-1]))
        elif kind == "in_proj_ba":  # per key head: [b (g), a (g)]
            g = self.nv_all // self.nk_all
            mine = loaded.narrow(0, r * self.num_k_heads * 2 * g, self.num_k_heads * 2 * g)
            b, a = mine.reshape(self.num_k_heads, 2 * g, -1).split([g, g], 1)
            self._copy_shard(4, b.reshape(nv, -1))
            self._copy_shard(5, a.reshape(nv, -1))
        else:
            raise ValueError(f"linear_attn.{kind}: not a Gated DeltaNet projection")

    def mix(self, proj: torch.Tensor) -> torch.Tensor:
        """The layer from in_proj's output on: conv, gates, recurrence, gated norm, out_proj."""
        if self.ssm_state.numel() == 0:
            raise RuntimeError("state slots not allocated: the model runner binds them first")
        meta = get_state_metadata()
        t = proj.shape[0]
        ks, vs, nv = self.key_size, self.value_size, self.num_v_heads
        if t == meta.slot_ids.shape[0] and meta.spec_slots is None:
            # One token per row (the scheduler never runs a row without tokens, so as many
            # tokens as rows means a decode batch; decided from shapes, no host sync): conv,
            # gates, recurrence and gated norm in one launch.
            o = ops.gated_delta_net_decode_(
                proj, self.conv_weight, self.conv_state, self.ssm_state, self.A_log,
                self.dt_bias, self.norm.weight, self.norm.eps, meta.slot_ids,
                meta.has_initial_state, self.k_dim**-0.5,
            )  # fmt: skip
            return self.out_proj(o)
        z = proj[:, self.conv_dim : self.conv_dim + vs]
        b = proj[:, self.conv_dim + vs : self.conv_dim + vs + nv]
        a = proj[:, self.conv_dim + vs + nv :]
        mixed = self._run_rows(ops.causal_conv1d_, ops.causal_conv1d_verify_, meta, (
            proj[:, : self.conv_dim], self.conv_weight, None, self.conv_state,
            meta.query_start_loc,
        ), (meta.has_initial_state, "silu"))  # fmt: skip
        q = mixed[:, :ks].reshape(t, self.num_k_heads, self.k_dim)
        k = mixed[:, ks : 2 * ks].reshape(t, self.num_k_heads, self.k_dim)
        v = mixed[:, 2 * ks :].reshape(t, nv, self.v_dim)
        g, beta = ops.gdn_gating(a, b, self.A_log, self.dt_bias)
        o = self._run_rows(ops.gated_delta_rule_, ops.gated_delta_rule_verify_, meta, (
            q, k, v, g, beta, self.ssm_state, meta.query_start_loc,
        ), (meta.has_initial_state, self.k_dim**-0.5, True))  # fmt: skip
        o = ops.gated_rms_norm(
            o.reshape(t * nv, self.v_dim),
            z.reshape(t * nv, self.v_dim),
            self.norm.weight,
            self.norm.eps,
        )
        return self.out_proj(o.reshape(t, vs))

    @staticmethod
    def _run_rows(plain, verified, meta, head: tuple, tail: tuple) -> torch.Tensor:
        """A state op over the step's rows: `plain` on `meta.slot_ids`, and in a speculative
        verify step `verified` on `meta.spec_slots` (keeping the state after every token), each
        with the other's rows masked (zero output there), summed."""
        if meta.spec_slots is None:
            return plain(*head, meta.slot_ids, *tail)
        out = verified(*head, meta.spec_slots, *tail)
        if not meta.spec_only:
            out = out + plain(*head, meta.slot_ids, *tail)
        return out


class HybridDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.is_linear = cfg.layer_types[index] == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = GatedAttention(cfg)
        if cfg.is_moe_layer(index):
            self.mlp = SparseMoE(cfg.moe_spec())
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size)
        self.dense_mlp = isinstance(self.mlp, DenseMLP)
        if self.dense_mlp:
            self.mlp.gate_up_proj.norm_before = True  # called with the post-attention norm
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, hidden, residual):
        # Each norm runs with the projection after it: one kernel for a one-row batch when the
        # GEMV with the norm fused in won for that shape (layers.linear). The MoE's router and
        # shared expert read the normed row, so a MoE layer's post-attention norm runs alone.
        norm, post_norm = self.input_layernorm, self.post_attention_layernorm
        if self.is_linear:
            proj, residual = self.linear_attn.in_proj.forward_normed(hidden, residual, norm)
            mixed = self.linear_attn.mix(proj)
        else:
            qkv, residual = self.self_attn.qkv_proj.forward_normed(hidden, residual, norm)
            mixed = self.self_attn.attend(positions, qkv)
        if self.dense_mlp:
            gate_up = self.mlp.gate_up_proj
            h, residual = gate_up.forward_normed(mixed, residual, post_norm)
            return self.mlp.down_proj(h), residual
        normed, residual = post_norm(mixed, residual)
        return self.mlp(normed), residual


# Checkpoint prefixes a text-only engine drops: the vision tower and the multi-token-prediction
# head of the Qwen3.5 / Qwen3-Next releases.
_SKIPPED = ("model.visual.", "mtp.", "model.mtp.", "visual.")


class Qwen3NextForCausalLM(CausalLM):
    """Qwen3.5 (`qwen3_5`, `qwen3_5_text`), Qwen3.5-MoE (`qwen3_5_moe`, `qwen3_5_moe_text`) and
    Qwen3-Next (`qwen3_next`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        if not cfg.is_hybrid:
            raise ValueError(f"model_type {cfg.model_type!r} is not a hybrid model")
        layers = (HybridDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        super().__init__(cfg, DecoderTrunk(cfg, layers, norm))

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers if not layer.is_linear]

    def state_layers(self) -> list[GatedDeltaNet]:
        return [layer.linear_attn for layer in self.model.layers if layer.is_linear]

    def checkpoint_name(self, name: str) -> str | None:
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model.") :]
        if name.startswith(_SKIPPED):
            return None
        return super().checkpoint_name(name)

    def load_weights(self, weights) -> set[str]:
        """The common loader, then a check that every stacked shared expert got its router rows
        and all of its tensors (their parameters count as loaded after any one of them)."""
        loaded = super().load_weights(weights)
        check_stacked_experts(self)
        return loaded

    def load_special(self, name: str, tensor) -> str | None:
        return load_hybrid_special(self, name, tensor)


def check_stacked_experts(model: nn.Module) -> None:
    """Every stacked shared expert got its router rows and all of its tensors (their
    parameters count as loaded after any one of them)."""
    missing = [
        f"{name}.{tensor}"
        for name, module in model.named_modules()
        if isinstance(module, SparseMoE) and module.stacked_shared
        for tensor in SparseMoE.STACKED_TENSORS
        if tensor not in module.stacked_loaded
    ]
    if missing:
        raise ValueError(f"checkpoint is missing tensors: {missing[:8]}")


def load_hybrid_special(model: nn.Module, name: str, tensor) -> str | None:
    """GDN projections, the conv weight, MoE experts and a stacked shared expert (with the
    router it joins) of `model`'s `model.layers.N`: their own loaders. Returns the parameter
    loaded, or None for an ordinary tensor."""
    m = re.fullmatch(r"(model\.layers\.\d+)\.linear_attn\.(\w+)\.weight", name)
    if m and m.group(2).startswith("in_proj"):
        model.get_submodule(f"{m.group(1)}.linear_attn").load_projection(m.group(2), tensor)
        return f"{m.group(1)}.linear_attn.in_proj.weight"
    if m and m.group(2) == "conv1d":
        gdn = model.get_submodule(f"{m.group(1)}.linear_attn")
        gdn.conv_weight.weight_loader(gdn.conv_weight, tensor)
        return f"{m.group(1)}.linear_attn.conv_weight"
    m = re.fullmatch(r"(model\.layers\.\d+\.mlp)\.((?:shared_expert\w*|gate)\..+)", name)
    if m:
        moe = model.get_submodule(m.group(1))
        if isinstance(moe, SparseMoE) and moe.stacked_shared:
            return f"{m.group(1)}.{moe.load_stacked_shared(m.group(2), tensor)}"
    return load_routed_expert(model, name, tensor)

"""DeepSeek-V2 / V3 / R1 (`deepseek_v2`, `deepseek_v3`): multi-head latent attention over a
latent KV cache, dense MLP layers first, then mixture-of-experts layers with shared experts and
grouped top-k routing. One model class serves both types; what differs is in their configs
(models/mla_config.py).

Attention of a layer (per token): the input norm, then q_a_proj and kv_a_proj_with_mqa as one
replicated GEMM (`fused_qkv_a_proj`; without q_lora, V2-Lite, q_proj is its own head-split
GEMM), q_a_layernorm and q_b_proj for the query ([heads, nope + rope]); the latent (kv_lora_rank,
normed by kv_a_layernorm) and the shared rope key go to the cache; attention and its output
through W_UV happen in `layers.latent_attention.LatentAttention`; o_proj. Rotary covers the rope
channels only, interleaved pairs (DeepSeek's layout) unless `rope_interleave` is false, from
one cos/sin table the model shares across layers (YaRN's attention factor folded in); the
softmax scale is qk_head_dim^-0.5 times YaRN's mscale(mscale_all_dim) squared.

Checkpoints: the tensors of transformers' and DeepSeek's releases (experts one by one or
fused). The multi-token-prediction layers that follow the decoder layers
(`num_nextn_predict_layers`, stored as `model.layers.{num_hidden_layers + k}`) are skipped with
one INFO line: they are the `mtp` speculative method's head (models/deepseek_mtp.py). Every linear layer is a `LinearBase`
(a quantized linear plugs in by subclassing it); MLA multiplies by parts of kv_b_proj itself,
through `LinearBase.dense_weight`. FP8 checkpoints (DeepSeek-V3's 128x128 blocks) load their
linear layers as FP8 (kv_b_proj and the routed experts dequantized, models/fp8_loading.py).
"""

from __future__ import annotations

import logging
import re

import torch
from torch import nn

from atom_runtime.layers.forward_context import get_attention_metadata
from atom_runtime.layers.latent_attention import LatentAttention
from atom_runtime.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedReplicatedLinear,
    RowParallelLinear,
    _divide,
)
from atom_runtime.layers.moe import DenseMLP, load_routed_expert
from atom_runtime.layers.norm import RMSNorm
from atom_runtime.layers.rotary import RotaryEmbedding, softmax_scale_correction
from atom_runtime.models.causal_lm import CausalLM, DecoderTrunk
from atom_runtime.models.config import ModelConfig
from atom_runtime.models.deepseek_moe import GroupedTopkMoE
from atom_runtime.system.distributed import tp_size

log = logging.getLogger(__name__)

_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")


class DeepseekAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        mla, h, eps = cfg.mla, cfg.hidden_size, cfg.rms_norm_eps
        heads = _divide(cfg.num_attention_heads, tp_size(), "attention heads")
        self.num_heads, self.qk_head_dim = heads, mla.qk_head_dim
        self.q_lora_rank = mla.q_lora_rank
        self.latent_width = mla.kv_lora_rank + mla.qk_rope_head_dim
        q_out = cfg.num_attention_heads * mla.qk_head_dim
        if self.q_lora_rank:
            self.fused_qkv_a_proj = MergedReplicatedLinear(
                h, [self.q_lora_rank, self.latent_width], bias=cfg.attention_bias
            )
            self.fused_qkv_a_proj.norm_before = True  # the decoder layer calls it normed
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, q_out)
        else:
            self.q_proj = ColumnParallelLinear(h, q_out)
            self.kv_a_proj_with_mqa = LinearBase(h, self.latent_width, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, eps)
        self.kv_b_proj = ColumnParallelLinear(
            mla.kv_lora_rank, cfg.num_attention_heads * (mla.qk_nope_head_dim + mla.v_head_dim)
        )
        # Absorbed attention multiplies by parts of kv_b_proj's weight every step: it stays in
        # the run dtype (an FP8 checkpoint's is dequantized at load, docs/quantization.md).
        self.kv_b_proj.quantizable = False
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * mla.v_head_dim, h, bias=cfg.attention_bias
        )
        scale = mla.qk_head_dim**-0.5 * softmax_scale_correction(cfg.rope_scaling)
        self.attn = LatentAttention(
            heads, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim,
            mla.v_head_dim, scale, rope_is_neox=not mla.rope_interleave,
        )  # fmt: skip
        object.__setattr__(self, "rotary", rotary)  # the model's shared table, not a submodule

    def project(self, hidden: torch.Tensor, residual, norm: RMSNorm):
        """The input norm (adding `residual` first when given) and the q / kv_a projections.
        Returns (q [T, heads, qk_head_dim], kv_a [T, latent + rope], residual after the add)."""
        if self.q_lora_rank:
            qkv_a, residual = self.fused_qkv_a_proj.forward_normed(hidden, residual, norm)
            q_c, kv_a = qkv_a.split([self.q_lora_rank, self.latent_width], dim=-1)
            q = self.q_b_proj(self.q_a_layernorm(q_c))
        else:
            normed, residual = norm.with_residual(hidden, residual)
            q, kv_a = self.q_proj(normed), self.kv_a_proj_with_mqa(normed)
        return q.view(-1, self.num_heads, self.qk_head_dim), kv_a, residual

    def attend(self, positions: torch.Tensor, q: torch.Tensor, kv_a: torch.Tensor) -> torch.Tensor:
        """Cache write and attention: [T, heads * v_head_dim], o_proj's input."""
        return self.attn(
            q, kv_a, positions, self.rotary.cos_sin_cache, self.kv_a_layernorm, self.kv_b_proj
        )


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = DeepseekAttention(cfg, rotary)
        if cfg.is_moe_layer(index):
            self.mlp = GroupedTopkMoE(cfg)
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size)
            self.mlp.gate_up_proj.norm_before = True  # called with the post-attention norm
        self.dense_mlp = isinstance(self.mlp, DenseMLP)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, hidden, residual):
        # Each norm runs with the projection after it where the layer group chose that (one
        # kernel for a one-row batch); a MoE layer's router and shared experts read the normed
        # row, so its post-attention norm runs alone.
        attn, post_norm = self.self_attn, self.post_attention_layernorm
        q, kv_a, residual = attn.project(hidden, residual, self.input_layernorm)
        hidden = attn.o_proj(attn.attend(positions, q, kv_a))
        if self.dense_mlp:
            h, residual = self.mlp.gate_up_proj.forward_normed(hidden, residual, post_norm)
            return self.mlp.down_proj(h), residual
        normed, residual = post_norm(hidden, residual)
        return self.mlp(normed), residual


class DeepseekForCausalLM(CausalLM):
    """`deepseek_v2` and `deepseek_v3` (DeepSeek-V2, V2-Lite, V2.5, V3, R1 and their kin)."""

    def __init__(self, cfg: ModelConfig) -> None:
        if cfg.mla is None:
            raise ValueError(f"model_type {cfg.model_type!r} has no multi-head latent attention")
        rotary = RotaryEmbedding(
            cfg.mla.qk_rope_head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        layers = (DeepseekDecoderLayer(cfg, i, rotary) for i in range(cfg.num_hidden_layers))
        norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        super().__init__(cfg, DecoderTrunk(cfg, layers, norm))
        self.rotary = rotary
        stacked = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
        if cfg.mla.q_lora_rank:
            stacked |= {
                "q_a_proj": ("fused_qkv_a_proj", 0),
                "kv_a_proj_with_mqa": ("fused_qkv_a_proj", 1),
            }
        self.stacked_params = stacked
        self._skipped_mtp = 0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # What the first MLA layer derives from the step's metadata (the absorbed rows, the
        # chunk plan) the others reuse, within this forward only: a CUDA graph captured after
        # warm-up forwards must record that work, not reuse the warm-ups' tensors.
        get_attention_metadata().derived.clear()
        return super().forward(input_ids, positions)

    def attention_layers(self) -> list[LatentAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def checkpoint_name(self, name: str) -> str | None:
        m = _LAYER_INDEX.match(name)
        if m is not None:
            index, first_mtp = int(m.group(1)), self.config.num_hidden_layers
            if first_mtp <= index < first_mtp + self.config.num_nextn_predict_layers:
                self._skipped_mtp += 1
                return None
        return super().checkpoint_name(name)

    def load_weights(self, weights) -> set[str]:
        self._skipped_mtp = 0
        loaded = super().load_weights(weights)
        if self._skipped_mtp:
            n, first = self.config.num_nextn_predict_layers, self.config.num_hidden_layers
            log.info(
                "skipped %d tensors of the %d multi-token-prediction layer(s) (model.layers.%d%s):"
                " the `mtp` speculative method's head (models/deepseek_mtp.py) reads them",
                self._skipped_mtp, n, first, f"-{first + n - 1}" if n > 1 else "",
            )  # fmt: skip
        return loaded

    def load_special(self, name: str, tensor) -> str | None:
        return load_routed_expert(self, name, tensor)

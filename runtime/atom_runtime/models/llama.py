"""The Llama decoder family: Llama 2/3, Mistral, Qwen2 (QKV bias), Qwen3 (QK-norm), SmolLM2,
and the same trunk with sparse MoE layers: Qwen3-MoE (`mlp_only_layers`, `decoder_sparse_step`,
`norm_topk_prob`), Mixtral, and GPT-OSS (models/gpt_oss.py adds its checkpoint format).

RMSNorm, rotary embedding (llama3 or YaRN scaling; one table the layers share), SwiGLU MLP or a
sparse MoE (layers/moe.py), grouped-query attention over the paged KV cache (a sliding window
on the layers the config names, attention sinks for GPT-OSS), optionally tied embeddings.
Layers are tensor-parallel aware; with one rank they are plain matmuls.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from atom_runtime.layers.attention import PagedAttention
from atom_runtime.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from atom_runtime.layers.moe import SparseMoE, load_routed_expert
from atom_runtime.layers.norm import RMSNorm
from atom_runtime.layers.rotary import RotaryEmbedding
from atom_runtime.models.causal_lm import CausalLM, DecoderTrunk
from atom_runtime.models.config import ModelConfig


def rotary_for(cfg: ModelConfig) -> RotaryEmbedding:
    return RotaryEmbedding(
        cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
    )


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size,
            cfg.head_dim,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            bias=cfg.attention_bias,
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.qkv_proj.norm_before = True  # the decoder layer calls it with its input norm
        self.qkv_proj.pads_for_attention = True  # fresh prompts' dense attention pads it
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.output_bias
        )
        self.rotary = rotary
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # QK-norm (when the model has it), rotary and the cache store can run in the qkv
        # GEMV's epilogue.
        self.qkv_proj.rope_after = True
        self.qkv_proj.qk_norm_after = self.q_norm is not None
        self.attn = PagedAttention(
            self.num_heads, self.num_kv_heads, cfg.head_dim, cfg.head_dim**-0.5,
            sliding_window=cfg.sliding_window if cfg.is_sliding_layer(index) else None,
            sinks=cfg.attention_sinks,
        )  # fmt: skip

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.attend(positions, self.qkv_proj(hidden))

    def attend_normed(self, positions, hidden, residual, norm):
        """`norm` (adding `residual` first when given), the qkv projection, attention, o_proj.
        Returns (output, residual after the add)."""
        proj = self.qkv_proj
        if proj.fuses_rope(hidden):
            rope = (positions, self.rotary.cos_sin_cache)
            if self.q_norm is not None:
                rope += (self.q_norm.weight, self.k_norm.weight)
            eps = self.q_norm.eps if self.q_norm is not None else 1e-6
            if proj.fuse_norm:  # the input norm in the same launch
                q, residual = self.attn.prepare_one_row(
                    hidden, proj.weight, proj.bias, *rope, eps=eps, norm=norm, residual=residual,
                    **proj.gemv_scales(),
                )  # fmt: skip
            else:
                normed, residual = norm.with_residual(hidden, residual)
                q, _ = self.attn.prepare_one_row(
                    normed, proj.weight, proj.bias, *rope, eps=eps, **proj.gemv_scales()
                )
            return self.o_proj(self.attn(q)), residual
        qkv, residual = proj.forward_normed(hidden, residual, norm)
        return self.o_proj(self.attention(positions, qkv)), residual

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """Attention from the fused qkv projection on: QK-norm, rotary, cache, o_proj."""
        return self.o_proj(self.attention(positions, qkv))

    def attention(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """`attend` up to o_proj: QK-norm, rotary, cache, attention, [T, heads * head_dim]."""
        if self.q_norm is not None:
            q, k, v = self.attn.prepare(
                qkv,
                positions,
                self.rotary.cos_sin_cache,
                self.q_norm.weight,
                self.k_norm.weight,
                self.q_norm.eps,
            )
        else:
            q, k, v = self.attn.prepare(qkv, positions, self.rotary.cos_sin_cache)
        return self.attn(q, k, v)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2)
        self.gate_up_proj.norm_before = True
        self.gate_up_proj.act_after = "silu_mul"  # it returns silu(gate) * up
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, index, rotary)
        self.sparse = cfg.is_moe_layer(index)
        self.mlp = SparseMoE(cfg.moe_spec()) if self.sparse else LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, hidden, residual):
        # Each norm runs with the projection after it (one kernel for a one-row batch when
        # the GEMV won for that shape, see layers.linear).
        attn, mlp = self.self_attn, self.mlp
        hidden, residual = attn.attend_normed(positions, hidden, residual, self.input_layernorm)
        if self.sparse:  # the router and the experts read the normed row
            normed, residual = self.post_attention_layernorm(hidden, residual)
            return mlp(normed), residual
        h, residual = mlp.gate_up_proj.forward_normed(
            hidden, residual, self.post_attention_layernorm
        )
        return mlp.down_proj(h), residual


# Mixtral's checkpoints: `block_sparse_moe` for `mlp`, experts' w1 / w3 / w2 for gate / up / down.
_MIXTRAL_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_MIXTRAL_NAME = re.compile(r"(.*)\.block_sparse_moe\.(?:experts\.(\d+)\.(w[123])\.weight|(.*))")


class LlamaForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        rotary = rotary_for(cfg)  # one cos/sin table for every layer
        layers = (LlamaDecoderLayer(cfg, i, rotary) for i in range(cfg.num_hidden_layers))
        super().__init__(cfg, DecoderTrunk(cfg, layers, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)))

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def checkpoint_name(self, name: str) -> str | None:
        m = _MIXTRAL_NAME.fullmatch(name)
        if m is not None:
            rest = m.group(4) or f"experts.{m.group(2)}.{_MIXTRAL_EXPERT[m.group(3)]}.weight"
            name = f"{m.group(1)}.mlp.{rest}"
        return super().checkpoint_name(name)

    def load_special(self, name: str, tensor) -> str | None:
        """Routed experts (`mlp.experts.*`): the MoE layer's own loader."""
        return load_routed_expert(self, name, tensor)

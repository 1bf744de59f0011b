"""The MTP head of Qwen3.5 / Qwen3.5-MoE / Qwen3-Next (`mtp.*` in their checkpoints; config
`mtp_num_hidden_layers` or `num_nextn_predict_layers`).

For (hidden state h_j of the target at position j, token t_{j+1}):
x = fc([pre_fc_norm_embedding(embed(t_{j+1})) ; pre_fc_norm_hidden(h_j)]), then one
gated-attention decoder layer (the target's full-attention layer shape, its MLP a MoE when the
model has experts), then `norm`; the target's LM head gives the logits of t_{j+2}. Every norm
scales by (1 + weight), as the target's do. Under tensor parallelism it runs whole on rank 0,
its `target` a whole-vocabulary copy (spec_decode/whole_vocab.py).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from atom_runtime.layers.linear import LinearBase
from atom_runtime.models.causal_lm import CausalLM
from atom_runtime.models.config import ModelConfig
from atom_runtime.models.mtp import MtpHead, mtp_tensor_name
from atom_runtime.models.qwen3_next import (
    HybridDecoderLayer,
    OffsetRMSNorm,
    check_stacked_experts,
    load_hybrid_special,
)


class Qwen3NextMtp(MtpHead):
    def __init__(self, cfg: ModelConfig, target: CausalLM) -> None:
        n = cfg.num_nextn_predict_layers
        if n < 1:
            raise ValueError(f"{cfg.model_type}: the config declares no MTP layers")
        # The layer shape of the target's full-attention layers; MoE whenever it has experts.
        layer_cfg = dataclasses.replace(
            cfg,
            num_hidden_layers=n,
            layer_types=["full_attention"] * n,
            mlp_only_layers=[],
            decoder_sparse_step=1,
        )
        super().__init__(target, n)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.fc = LinearBase(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = OffsetRMSNorm(h, eps)
        self.pre_fc_norm_hidden = OffsetRMSNorm(h, eps)
        self.model = nn.Module()  # `model.layers.N`: the names the hybrid loaders expect
        self.model.layers = nn.ModuleList(HybridDecoderLayer(layer_cfg, i) for i in range(n))
        self.norm = OffsetRMSNorm(h, eps)

    def run_layer(self, layer, positions, embedded, previous_hidden) -> torch.Tensor:
        embedded = self.pre_fc_norm_embedding(embedded)
        x = self.fc(torch.cat([embedded, self.pre_fc_norm_hidden(previous_hidden)], dim=-1))
        hidden, residual = layer(positions, x, None)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def checkpoint_name(self, name: str) -> str | None:
        name = mtp_tensor_name(name)
        if name is not None and name.startswith("layers."):
            return "model." + name  # `model.layers.N`: the names the hybrid loaders expect
        return name

    def load_special(self, name: str, tensor) -> str | None:
        return load_hybrid_special(self, name, tensor)

    def check_loaded(self) -> None:
        check_stacked_experts(self)

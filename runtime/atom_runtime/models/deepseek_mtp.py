"""The MTP head of DeepSeek-V3 / R1 (`num_nextn_predict_layers` in the config; its tensors
stored as `model.layers.{L}.*` for L = num_hidden_layers, ..., after the decoder layers).

For (the target's final hidden state h_j at position j, token t_{j+1}), per head layer:
x = eh_proj([enorm(embed(t_{j+1})) ; hnorm(h_j)]), then one decoder layer of the target's shape
(MLA attention, the MLP a MoE when layer L is one, as in every released checkpoint), then
`shared_head.norm`; the target's LM head gives the logits of t_{j+2}. A further draft reads the
normed output in place of h_j (as transformers' `MtpLayer` and SGLang chain it; vLLM feeds the
un-normed one instead: the same with one draft a layer).

The checkpoint's `embed_tokens` and `shared_head.head` of each layer are copies of the target's
embedding and LM head (DeepSeek-V3 trains them shared): they are not read, the target's serve.
The head's attention is MLA: its latent KV (kv_lora_rank + qk_rope_head_dim values a token, as
a target layer's) sits beside the target's under the same block ids. An FP8 checkpoint's head is
dequantized at load (models/fp8_loading.mtp_head_stream).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from atom_runtime.layers.forward_context import get_attention_metadata
from atom_runtime.layers.linear import LinearBase
from atom_runtime.layers.moe import load_routed_expert
from atom_runtime.layers.norm import RMSNorm
from atom_runtime.models.config import ModelConfig
from atom_runtime.models.deepseek import DeepseekDecoderLayer, DeepseekForCausalLM
from atom_runtime.models.mtp import MtpHead

_LAYER_TENSOR = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Copies of the target's embedding and LM head in every MTP layer: the target's serve.
_SHARED_WITH_TARGET = ("embed_tokens.", "shared_head.head.")


class DeepseekMtpLayer(DeepseekDecoderLayer):
    """A decoder layer (index `index` of the checkpoint) with the MTP inputs' norms and
    projection and the output norm around it."""

    def __init__(self, cfg: ModelConfig, index: int, rotary) -> None:
        super().__init__(cfg, index, rotary)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm = RMSNorm(h, eps)
        self.hnorm = RMSNorm(h, eps)
        self.eh_proj = LinearBase(2 * h, h, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(h, eps)


class DeepseekMtp(MtpHead):
    def __init__(self, cfg: ModelConfig, target: DeepseekForCausalLM) -> None:
        n = cfg.num_nextn_predict_layers
        if n < 1:
            raise ValueError(f"{cfg.model_type}: the config declares no MTP layers")
        super().__init__(target, n)
        self.first_index = cfg.num_hidden_layers
        self.stacked_params = target.stacked_params
        self.model = nn.Module()  # `model.layers.N` (N = L - first_index): the loaders' names
        self.model.layers = nn.ModuleList(
            DeepseekMtpLayer(cfg, self.first_index + i, target.rotary) for i in range(n)
        )

    def run_layer(self, layer, positions, embedded, previous_hidden) -> torch.Tensor:
        get_attention_metadata().derived.clear()  # as the target's forward (models/deepseek.py)
        x = layer.eh_proj(torch.cat([layer.enorm(embedded), layer.hnorm(previous_hidden)], -1))
        hidden, residual = layer(positions, x, None)
        hidden, _ = layer.shared_head.norm(hidden, residual)
        return hidden

    def checkpoint_name(self, name: str) -> str | None:
        m = _LAYER_TENSOR.fullmatch(name)
        if m is None:
            return None
        i, rest = int(m.group(1)) - self.first_index, m.group(2)
        if not 0 <= i < self.num_layers or rest.startswith(_SHARED_WITH_TARGET):
            return None
        return f"model.layers.{i}.{rest}"

    def load_special(self, name: str, tensor) -> str | None:
        return load_routed_expert(self, name, tensor)

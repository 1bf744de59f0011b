"""GPT-OSS (gpt-oss-20b, gpt-oss-120b): the Llama trunk of models/llama.py with

- attention: q/k/v/o biases, YaRN rotary, a learned sink logit per head, and every other layer
  (`layer_types`: sliding_attention) attending over its last `sliding_window` (128) positions;
- MoE in every layer: a router with a bias whose softmax over the top-k logits gives the same
  weights as a renormalised softmax over all, experts with biases on gate/up and down, and a
  clamped SwiGLU (`gate.clamp(max=limit) * sigmoid(alpha * gate) * (up.clamp(+-limit) + 1)`).

What this file adds is the checkpoint format. The experts come fused, gate and up interleaved
by row (gate rows even, up rows odd), either as transformers saves them (`gate_up_proj`
[E, H, 2I], `down_proj` [E, I, H]) or as the released checkpoints store them: MXFP4
(`gate_up_proj_blocks` [E, 2I, H/32, 16] with `gate_up_proj_scales` [E, 2I, H/32], likewise
`down_proj_*` [E, H, I/32, ...]), which is dequantized here to the run's dtype at load time
(models/mxfp4.py; native MXFP4 kernels are a later step). A rank reads only its experts' rows:
interleaved rows [2 r I/tp, 2 (r+1) I/tp) are exactly its gate and up rows.
"""

from __future__ import annotations

import re

import torch

from atom_runtime.layers.moe import SparseMoE
from atom_runtime.models.config import ModelConfig
from atom_runtime.models.llama import LlamaForCausalLM
from atom_runtime.models.mxfp4 import dequantize_mxfp4
from atom_runtime.system.distributed import tp_rank

_EXPERTS = re.compile(
    r"(model\.layers\.\d+\.mlp)\.experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?"
)


class GptOssForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        if cfg.model_type != "gpt_oss":
            raise ValueError(f"model_type {cfg.model_type!r} is not gpt_oss")
        super().__init__(cfg)
        # MXFP4 halves read so far, waiting for the other: (layer's mlp, projection) -> parts.
        self._pending: dict[tuple[str, str], dict[str, torch.Tensor]] = {}

    def checkpoint_name(self, name: str) -> str | None:
        name = name.replace(".mlp.router.", ".mlp.gate.")
        name = name.replace(".self_attn.sinks", ".self_attn.attn.sinks")
        return super().checkpoint_name(name)

    def load_weights(self, weights) -> set[str]:
        loaded = super().load_weights(weights)
        if self._pending:
            half = sorted(
                f"{mlp}.experts.{proj}_{next(iter(parts))}"
                for (mlp, proj), parts in self._pending.items()
            )
            raise ValueError(f"checkpoint is missing the other MXFP4 half of: {half[:8]}")
        return loaded

    def load_special(self, name: str, tensor) -> str | None:
        m = _EXPERTS.fullmatch(name)
        if m is None:
            return super().load_special(name, tensor)
        mlp_name, proj, suffix = m.groups()
        moe = self.get_submodule(mlp_name)
        if not isinstance(moe, SparseMoE):
            raise ValueError(f"checkpoint tensor {name!r}: layer has no experts here")
        if suffix == "_bias":
            _load_bias(moe, proj, tensor)
            return f"{mlp_name}.{'w13_bias' if proj == 'gate_up_proj' else 'w2_bias'}"
        if suffix is None:  # transformers' layout: [E, in, out]
            _load_weight(moe, proj, _whole(tensor).transpose(1, 2))
        else:
            parts = self._pending.setdefault((mlp_name, proj), {})
            parts[suffix[1:]] = _read_rows(moe, proj, tensor)
            if len(parts) < 2:
                return f"{mlp_name}.{'w13' if proj == 'gate_up_proj' else 'w2'}"
            del self._pending[(mlp_name, proj)]
            weight = dequantize_mxfp4(
                parts["blocks"].to(moe.w13.device), parts["scales"].to(moe.w13.device),
                moe.w13.dtype,
            )  # fmt: skip
            _load_weight(moe, proj, weight, rows_narrowed=proj == "gate_up_proj")
        return f"{mlp_name}.{'w13' if proj == 'gate_up_proj' else 'w2'}"


def _read_rows(moe: SparseMoE, proj: str, tensor) -> torch.Tensor:
    """This rank's part of an MXFP4 blocks or scales tensor, read now (the checkpoint file may
    close before its other half arrives): for gate_up the rank's interleaved rows, for down
    every row (its columns are cut after dequantizing)."""
    if proj == "gate_up_proj":
        i = moe.inter
        return tensor.narrow(1, 2 * tp_rank() * i, 2 * i).contiguous()
    return _whole(tensor).contiguous()


def _load_weight(moe: SparseMoE, proj: str, weight: torch.Tensor, rows_narrowed: bool = False):
    """An expert tensor in [E, out, in] layout (gate_up: interleaved rows; down: [E, H, I])."""
    i, r = moe.inter, tp_rank()
    if proj == "gate_up_proj":
        mine = weight if rows_narrowed else weight.narrow(1, 2 * r * i, 2 * i)
        moe.load_gate_up(mine[:, 0::2], mine[:, 1::2])
    else:
        moe.load_down(weight.narrow(2, r * i, i))


def _load_bias(moe: SparseMoE, proj: str, tensor) -> None:
    """gate_up_proj_bias [E, 2I] (interleaved: this rank's gate and up columns) or
    down_proj_bias [E, H] (whole: rank 0 adds it)."""
    full = _whole(tensor)
    if proj == "down_proj":
        moe.load_down(full, bias=True)
        return
    i = moe.inter
    mine = full.narrow(1, 2 * tp_rank() * i, 2 * i)
    moe.load_gate_up(mine[:, 0::2], mine[:, 1::2], bias=True)


def _whole(tensor) -> torch.Tensor:
    return tensor if isinstance(tensor, torch.Tensor) else tensor.read()

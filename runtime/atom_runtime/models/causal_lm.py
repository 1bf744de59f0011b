"""What every decoder-only model here shares: the trunk (embedding, decoder layers, final norm),
the LM head (tied to the embedding or not) and loading Hugging Face tensors into fused, sharded
parameters. A model family supplies its layers, its final norm and, where its checkpoints differ,
two hooks of the loader: `checkpoint_name` (rename or skip a tensor) and `load_special` (tensors
with loaders of their own)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from atom_runtime.layers.attention import PagedAttention
from atom_runtime.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from atom_runtime.layers.weights import copy_weight
from atom_runtime.models.config import ModelConfig

# checkpoint name fragment -> (our parameter fragment, shard id): the q/k/v and gate/up
# projections every family here stores separately and runs fused.
STACKED_PROJECTIONS = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class DecoderTrunk(nn.Module):
    """Embedding, then each layer as `layer(positions, hidden, residual)`, then the final norm
    with the last residual added. Parameter names are Hugging Face's (`model.embed_tokens`,
    `model.layers.N`, `model.norm`)."""

    def __init__(self, cfg: ModelConfig, layers: Iterable[nn.Module], norm: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = norm

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class CausalLM(nn.Module):
    """A trunk and an LM head. Subclasses say which layers hold paged attention."""

    stacked_params: ClassVar[dict[str, tuple[str, str | int]]] = STACKED_PROJECTIONS

    def __init__(self, cfg: ModelConfig, trunk: DecoderTrunk) -> None:
        super().__init__()
        self.config = cfg
        self.model = trunk
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[PagedAttention]:
        raise NotImplementedError

    def checkpoint_name(self, name: str) -> str | None:
        """The parameter name a checkpoint tensor loads into, or None to skip it (rotary
        tables, a tied head)."""
        if "rotary_emb.inv_freq" in name:
            return None
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None
        return name

    def load_special(self, name: str, tensor) -> str | None:
        """Load a tensor that has a loader of its own; returns the parameter name loaded, or
        None when `name` is an ordinary tensor."""
        return None

    def load_weights(self, weights) -> set[str]:
        """Copy (name, tensor) pairs in Hugging Face naming into this model's (possibly fused,
        sharded) parameters. Returns the names of the parameters that were loaded."""
        return load_checkpoint(self, weights)


def load_checkpoint(model: nn.Module, weights) -> set[str]:
    """`model.load_weights`'s loop for a model that names its tensors (`checkpoint_name`: None
    skips one), loads some its own way (`load_special`) and fuses `stacked_params`: a CausalLM
    or an MTP head. Returns the names of the parameters loaded."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for checkpoint_name, tensor in weights:
        name = model.checkpoint_name(checkpoint_name)
        if name is None:
            continue
        target = model.load_special(name, tensor)
        if target is None:
            target = load_ordinary(name, tensor, params, model.stacked_params)
        loaded.add(target)
    return loaded


def load_ordinary(
    name: str,
    tensor,
    params: dict[str, nn.Parameter],
    stacked: dict[str, tuple[str, str | int]] = STACKED_PROJECTIONS,
) -> str:
    """Copy one checkpoint tensor into its parameter (`params` by name; a projection stored
    apart but run fused goes into its shard of the fused one). Returns the parameter's name."""
    target, shard = name, None
    for fragment, (fused, shard_id) in stacked.items():
        if f".{fragment}." in name:
            target, shard = name.replace(f".{fragment}.", f".{fused}."), shard_id
            break
    param = params.get(target)
    if param is None:
        raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
    loader = getattr(param, "weight_loader", None)
    if shard is not None:
        loader(param, tensor, shard)
    elif loader is not None:
        loader(param, tensor)
    else:
        try:
            copy_weight(param.data, tensor)
        except ValueError as exc:
            raise ValueError(f"checkpoint tensor {name!r}: {exc}") from None
    return target

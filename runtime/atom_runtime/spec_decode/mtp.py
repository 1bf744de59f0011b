"""`mtp`: the target's own multi-token-prediction layers propose (models/mtp.py): at position j
the head reads the target's hidden state at j and the token at j + 1, so after every step it
catches up on the step's accepted positions from the hidden states the step computed, then
drafts k tokens, each from its own last hidden state. Its KV (one attention layer per head
layer) sits beside the target's under the same block ids."""

from __future__ import annotations

import logging

import torch

from atom_runtime.models.loader import build_mtp_head, resolve_model_path
from atom_runtime.spec_decode.model_drafter import ModelDrafter

log = logging.getLogger(__name__)


class MtpDrafter(ModelDrafter):
    needs_hidden_states = True
    token_shift = 1

    def __init__(self, spec, config, target_config, dtype: torch.dtype, target) -> None:
        device = next(target.parameters()).device
        path = resolve_model_path(config.model)
        self.head = build_mtp_head(
            path, target_config, target, config.load_format, dtype, device, config.seed + 1
        )
        super().__init__(
            spec.num_speculative_tokens,
            device,
            config.block_size,
            target_config.max_position_embeddings,
        )
        self.hidden_size = target_config.hidden_size
        self.dtype = dtype
        # The hidden states a captured step reads (allocated once, before any capture).
        self._previous: torch.Tensor | None = None
        if self.k > self.head.num_layers:
            log.info(
                "mtp: %d draft tokens from %d MTP layer(s): the layers are reused in turn",
                self.k,
                self.head.num_layers,
            )

    def attention_layers(self) -> list:
        return self.head.attention_layers()

    def layer_of(self, step: int) -> int:
        return step % self.head.num_layers

    def graph_model(self, layer: int, max_rows: int) -> torch.nn.Module:
        if self._previous is None:
            self._previous = torch.zeros(
                max_rows, self.hidden_size, dtype=self.dtype, device=self.device
            )
        elif len(self._previous) < max_rows:
            raise RuntimeError("the MTP graphs' hidden-state buffer is allocated at its largest")
        return _HeadStep(self.head, layer, self._previous)

    def _fill_previous(self, index: torch.Tensor, prev: torch.Tensor) -> None:
        self._previous.zero_()
        self._previous.index_copy_(0, index, prev.to(self._previous.dtype))

    def _forward(self, ids, positions, hidden, step: int = 0):
        return self.head(ids, positions, hidden, step)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head.compute_logits(hidden).float()


class _HeadStep(torch.nn.Module):
    """One MTP layer as a captured step sees it: (ids, positions) in, the previous hidden
    states read from a fixed buffer (filled before each replay)."""

    def __init__(self, head, layer: int, previous: torch.Tensor) -> None:
        super().__init__()
        object.__setattr__(self, "head", head)  # not a submodule: the drafter owns it
        self.layer = layer
        self.previous = previous

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.head(ids, positions, self.previous[: len(ids)], self.layer)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head.compute_logits(hidden)

"""Multi-token-prediction heads: the layers some checkpoints carry after the trunk, trained to
predict one token further (speculative decoding's `mtp` method, spec_decode/mtp.py).

A head plugs in by implementing `MtpHead` and being built by `build_mtp_head`
(models/loader.py): Qwen3.5 / Qwen3-Next (`qwen3_next_mtp.py`: `mtp.fc` over the normed
embedding and hidden state, one gated-attention decoder layer, a final norm); DeepSeek-V3's
(`enorm`, `hnorm`, `eh_proj`, a decoder layer, `shared_head`; transformers' `MtpLayer`) plugs in
the same way once its model lands. A head shares the target's embedding and LM head, holds its
own paged attention layers (their KV cache uses the target's block ids) and reads, at position
j, the target's final hidden state at j and the token at j + 1.
"""

from __future__ import annotations

from typing import Protocol

import torch


class MtpHead(Protocol):
    num_layers: int

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        previous_hidden: torch.Tensor,
        step: int = 0,
    ) -> torch.Tensor:
        """The head's final hidden states [T, hidden] for (previous_hidden [T, hidden], the
        next token's id) at `positions`; `step`: which draft this is (0: from the target's
        hidden states), choosing the layer when the head has several."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's LM head over the head's hidden states."""

    def attention_layers(self) -> list:
        """The head's paged attention layers."""

    def load_weights(self, weights) -> set[str]:
        """Load the head's tensors from (checkpoint name, tensor) pairs of the target's
        checkpoint (names outside the head skipped); returns the parameters loaded."""


def mtp_tensor_name(name: str) -> str | None:
    """A checkpoint tensor's name inside an MTP head (`mtp.` stripped; `model.mtp.` and
    `model.language_model.mtp.` too), or None when it is not the head's."""
    for prefix in ("mtp.", "model.mtp.", "model.language_model.mtp."):
        if name.startswith(prefix):
            return name[len(prefix) :]
    return None

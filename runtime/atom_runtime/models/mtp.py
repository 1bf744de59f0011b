"""Multi-token-prediction heads: the layers some checkpoints carry after the trunk, trained to
predict one token further (speculative decoding's `mtp` method, spec_decode/mtp.py).

A head subclasses `MtpHead` and is built by `build_mtp_head` (models/loader.py): Qwen3.5 /
Qwen3-Next (`qwen3_next_mtp.py`: `mtp.fc` over the normed embedding and hidden state, one
gated-attention decoder layer, a final norm) and DeepSeek-V3 / R1 (`deepseek_mtp.py`: `enorm`,
`hnorm`, `eh_proj`, one MLA decoder layer, `shared_head.norm`; transformers' `MtpLayer`). A head
shares the target's embedding and LM head, holds its own paged attention layers (their KV cache
uses the target's block ids) and reads, at position j, the target's final hidden state at j and
the token at j + 1. With more drafts than layers the layers are used in turn; each further draft
reads the head's own last (normed) hidden state in place of the target's.
"""

from __future__ import annotations

import torch
from torch import nn

from atom_runtime.models.causal_lm import STACKED_PROJECTIONS, load_checkpoint


class MtpHead(nn.Module):
    """What the drafter calls; a subclass builds `self.model.layers` (one module a head layer,
    each with `self_attn.attn`), says which checkpoint tensors are its own (`checkpoint_name`)
    and runs one layer (`run_layer`)."""

    stacked_params: dict[str, tuple[str, str | int]] = STACKED_PROJECTIONS

    def __init__(self, target: nn.Module, num_layers: int) -> None:
        super().__init__()
        self.num_layers = num_layers
        # The target's embedding and LM head, shared (not submodules: they stay its weights).
        object.__setattr__(self, "target", target)

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
        layer = self.model.layers[step % self.num_layers]
        embedded = self.target.model.embed_tokens(input_ids)
        return self.run_layer(layer, positions, embedded, previous_hidden)

    def run_layer(self, layer: nn.Module, positions, embedded, previous_hidden) -> torch.Tensor:
        """One head layer over (the next tokens' embeddings, the previous hidden states)."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's LM head over the head's hidden states."""
        return self.target.compute_logits(hidden)

    def attention_layers(self) -> list:
        """The head's paged attention layers."""
        return [layer.self_attn.attn for layer in self.model.layers]

    def checkpoint_name(self, name: str) -> str | None:
        """The head's parameter name for a checkpoint tensor, or None when it is not the head's
        (or is one the head shares with the target)."""
        raise NotImplementedError

    def load_special(self, name: str, tensor) -> str | None:
        """Load a tensor that has a loader of its own (routed experts); None otherwise."""
        return None

    def check_loaded(self) -> None:
        """Raise when what was loaded does not make a whole layer (fused experts half read)."""

    def load_weights(self, weights) -> set[str]:
        """Load the head's tensors from (checkpoint name, tensor) pairs of the target's
        checkpoint (names outside the head skipped); returns the parameters loaded."""
        loaded = load_checkpoint(self, weights)
        self.check_loaded()
        return loaded


def mtp_tensor_name(name: str) -> str | None:
    """A checkpoint tensor's name inside a Qwen-style MTP head (`mtp.` stripped; `model.mtp.` and
    `model.language_model.mtp.` too), or None when it is not the head's."""
    for prefix in ("mtp.", "model.mtp.", "model.language_model.mtp."):
        if name.startswith(prefix):
            return name[len(prefix) :]
    return None

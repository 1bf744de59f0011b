"""What a drafter is to the model runner, and how one is chosen from the config.

After every step the engine asks the runner for drafts for the step's live sequences
(`ModelRunner.propose`); the runner hands its drafter the sequences, where each one's chunk of
the step sat (`StepChunk`: first position and first row) and, for a drafter that reads them, the
step's hidden states. A drafter returns up to k tokens a sequence ([] for one still in its
prompt or with nothing to propose); the scheduler decides how many of them the next step
verifies. A drafting model keeps its own KV for every token the target computed (it runs the
step's accepted tokens after every step) and writes its k - 1 further inputs past them, in the
slots the scheduler reserved (`SpeculativeConfig.lookahead`).

The MTP interface (`MtpHead` in models/mtp.py) is what a model family implements to plug its
multi-token-prediction layers in: Qwen3.5 / Qwen3-Next now, DeepSeek-V3 once its model lands.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from atom_runtime.core.sequence import Sequence
from atom_runtime.system.distributed import rank_local, tp_rank, tp_size


@dataclass(frozen=True)
class StepChunk:
    """Where a sequence's tokens sat in the step just run."""

    start: int  # the first position the step computed for the sequence
    row: int  # its first row among the step's token rows


@dataclass(frozen=True)
class StepRecord:
    """What one step leaves its drafter: where each sequence's chunk sat (by `id(seq)`; None
    for a drafter that reads none) and the step's hidden states (None unless it reads them)."""

    chunks: dict[int, StepChunk] | None
    hidden: torch.Tensor | None


class Drafter(Protocol):
    # Whether `propose` reads the step's hidden states (`hidden`), and where each sequence's
    # chunk sat (`chunks`).
    needs_hidden_states: bool
    needs_step_chunks: bool

    def propose(
        self,
        seqs: list[Sequence],
        chunks: list[StepChunk | None],
        hidden: torch.Tensor | None,
    ) -> list[list[int]]:
        """Drafts to follow each sequence's last token ([] when none)."""

    def attention_layers(self) -> list:
        """The drafter's paged attention layers (their caches use the target's block ids)."""


def make_drafter(spec, config, model_config, target, dtype: torch.dtype) -> Drafter | None:
    """The drafter `spec` (a SpeculativeConfig, or None: no speculation) asks for, refused by
    name where the target cannot serve it. `target` is the built target model (an MTP head
    shares its embedding and LM head)."""
    if spec is None:
        return None
    spec.check_fits_model(model_config.model_type, model_config.num_nextn_predict_layers)
    if spec.method == "ngram":
        from atom_runtime.spec_decode.ngram import NgramDrafter

        return NgramDrafter(spec.num_speculative_tokens, spec.prompt_lookup_min,
                            spec.prompt_lookup_max)  # fmt: skip
    if tp_size() > 1:
        return _rank_zero_drafter(spec, config, model_config, target, dtype)
    return _model_drafter(spec, config, model_config, target, dtype)


def _rank_zero_drafter(spec, config, model_config, target, dtype: torch.dtype) -> Drafter | None:
    """Under tensor parallelism a drafting model runs whole on rank 0, outside the group
    (`rank_local`); its drafts reach the other ranks inside the next step's inputs. The other
    ranks get None (they only take part in gathering an MTP head's vocabulary)."""
    if spec.method == "mtp":
        from atom_runtime.spec_decode.whole_vocab import gather_whole_vocab

        target = gather_whole_vocab(target)  # a collective: every rank
    if tp_rank() != 0:
        return None
    with rank_local():
        drafter = _model_drafter(spec, config, model_config, target, dtype)
    drafter.outside_group = True
    return drafter


def _model_drafter(spec, config, model_config, target, dtype: torch.dtype) -> Drafter:
    if spec.method == "draft_model":
        from atom_runtime.spec_decode.draft_model import DraftModelDrafter

        return DraftModelDrafter(spec, config, model_config, dtype, target)
    from atom_runtime.spec_decode.mtp import MtpDrafter

    return MtpDrafter(spec, config, model_config, dtype, target)

"""What the scheduler hands the model runner (`ScheduledBatch`) and what comes back from a step
(`StepOutput`): the light types both sides import, so the runner never imports the scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field

from atom_runtime.core.sequence import Sequence
from atom_runtime.protocol.engine_core import StepOutputs


@dataclass
class ScheduledBatch:
    """What one step computes: for each sequence, how many of its tokens to run."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_preempted: int = 0
    # State checkpoints: this batch's id in the maintenance queue, and the unit table (int64
    # [R, 3], `UnitCopyTable.rows`) of the copies to run before its forward (None: none).
    batch_id: int | None = None
    state_copy: object | None = None

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


@dataclass
class StepOutput:
    """What a step sampled, read back to the host: row i belongs to `samplers[i]`. Logprobs (and
    the top ones) are there when a sampler of the step asked for them.

    A step that verified drafts (speculative decoding) emits one or more tokens a sampler:
    `num_tokens[i]` of them for `samplers[i]`, its rows one after another (the accepted drafts,
    then the target's own token). None: one row each."""

    samplers: list[Sequence]
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    num_tokens: list[int] | None = None

    def add_logprobs(self, outputs: StepOutputs, row: int, want: int | None) -> None:
        """Row `row`'s logprob and its top `want` alternatives into the step's outputs."""
        outputs.logprobs.append(self.logprobs[row])
        outputs.top_ids.append(self.top_ids[row][:want] if want else [])
        outputs.top_logprobs.append(self.top_logprobs[row][:want] if want else [])

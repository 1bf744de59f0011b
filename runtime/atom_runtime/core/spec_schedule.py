"""The scheduler's part of speculative decoding (docs/speculative-decoding.md): how many of a
sequence's drafts a step verifies, the cache slots it reserves for them, and applying what the
verify step emitted. No tensors here either.

A decoding sequence holding drafts (`Sequence.spec_token_ids`, set by the drafter after its last
step) runs its last token and up to k drafts in one step: the scheduler reserves KV for all of
them (plus, for a drafting model, `lookahead` slots its own KV is written to past them), places
them after the last token (`Sequence.place_drafts`) and counts them as computed at commit. When
the step is back, the rejected drafts' KV stops counting (`Sequence.take_verified`): the blocks
stay with the sequence (the next step writes there again) and only blocks of accepted tokens are
ever hashed and published (contract 2). The emitted tokens then go in one by one, each checked
for a stop, so a stop inside the accepted run ends the sequence right there.

Under async scheduling a speculating sequence sits out the steps launched while one of its steps
is in flight (`Scheduler._sits_out`; a prompt chunk's too): its next step's length, positions and
drafts follow from that step's acceptance, and a drafting model catches up on each step from that
step's record. Nor is it preempted then (`_victim_index`).

Hybrid models hold 1 + k state slots a sequence: the verify step writes the recurrent state
after each of its positions into slot i (slot 0 after the last token); taking the verified
tokens swaps the slot holding the state after the last accepted one into place 0.
"""

from __future__ import annotations

import time

from atom_runtime.core.batch import StepOutput
from atom_runtime.core.sequence import Sequence
from atom_runtime.protocol.engine_core import StepOutputs
from atom_runtime.protocol.spec_decode_stats import SpecDecodingStats


class SpeculativeSteps:
    """Scheduler's part that verifies drafts (a mixin: it reads the scheduler's limits, block
    manager, checkpoints and counters)."""

    num_speculative_tokens = 0  # k; 0: no speculation
    spec_lookahead = 0  # slots a step reserves past its verified tokens for the drafter
    spec_stats: SpecDecodingStats | None = None

    def _drafts_for(self, seq: Sequence, num_new: int, budget: int) -> list[int]:
        """The drafts seq verifies this step: none unless it is decoding (one token to run) and
        holds drafts; at most k, what the token budget leaves, what its max_tokens and the
        context length leave after the target's own token, and (guided) the run its grammar
        accepts."""
        drafts = seq.spec_token_ids
        if not drafts or num_new != 1 or seq.num_computed_tokens != seq.num_tokens - 1:
            return []
        cap = min(len(drafts), self.num_speculative_tokens, budget - 1)
        p = seq.sampling_params
        if p.max_tokens is not None:
            cap = min(cap, p.max_tokens - seq.num_output_tokens - 1)
        cap = min(cap, self.max_model_len - seq.num_tokens - 1)
        if cap > 0 and seq.matcher is not None:
            cap = min(cap, seq.matcher.validate_tokens(drafts[:cap]))
        return drafts[:cap] if cap > 0 else []

    def _allocate_step(self, seq: Sequence, num_new: int, drafts: list[int], hit=()) -> bool:
        """Allocate KV for num_new tokens plus the drafts and the drafter's lookahead when the
        step reaches the sequence's last token; short of blocks, without the speculative part
        (the drafter then proposes only as far as the blocks reach). Places the drafts when
        they got their slots; False when even the plain step does not fit."""
        bm = self.block_manager
        computed = len(hit) * bm.block_size if hit else seq.num_computed_tokens
        reaches_end = computed + num_new == seq.num_tokens
        extra = len(drafts) + (self.spec_lookahead if reaches_end else 0)
        # Never past the context length: block tables stay as wide as the graphs captured.
        extra = min(extra, self.max_model_len - computed - num_new)
        # The speculative part never reclaims checkpoints or preempts: live work comes first.
        if extra > 0 and bm.allocate(seq, num_new + extra, hit):
            if drafts:
                seq.place_drafts(drafts)
            return True
        return self._allocate(seq, num_new, hit)

    def _victim_index(self, i: int) -> int:
        """Where in `running` the sequence to preempt for running[i] sits: the newest one, at
        the latest running[i] itself. Speculating, never one with a step in flight: its verify
        step's outcome (drafts taken back, state slots swapped) is applied when it completes."""
        j = len(self.running) - 1
        if self.num_speculative_tokens:
            while j > i and self.running[j].steps_in_flight:
                j -= 1
        return j

    def _apply_verified(self, batch_id, output: StepOutput, outputs: StepOutputs) -> None:
        """Fill in a verify step's tokens: per sampler, take its drafts back and append what it
        emitted (accepted drafts, then the target's token), checking stops token by token."""
        from atom_runtime.core.scheduler import check_stop, request_update

        now = time.time()
        ids, tokens, updates = outputs.request_ids, outputs.token_ids, outputs.updates
        with_logprobs = output.logprobs is not None
        if with_logprobs:
            outputs.logprobs, outputs.top_ids, outputs.top_logprobs = [], [], []
        row = 0
        for seq, count in zip(output.samplers, output.num_tokens, strict=True):
            first_row, row = row, row + count
            if seq.is_finished:
                continue
            drafted = seq.num_spec
            self.spec_stats.observe(drafted, count - 1)
            seq.take_verified(count - 1)
            self._swap_state_slot(seq, count - 1)
            first = seq.first_token_time is None
            for r in range(first_row, row):
                token = output.token_ids[r]
                seq.token_ids.append(token)
                if seq.matcher is not None:
                    seq.matcher.consume_token(token)
                if seq.first_token_time is None:
                    seq.first_token_time = now
                check_stop(seq, token, self.eos_token_ids, self.max_model_len)
                ids.append(seq.request_id)
                tokens.append(token)
                if with_logprobs:
                    output.add_logprobs(outputs, r, seq.sampling_params.logprobs)
                if seq.is_finished:
                    break
            # A stop on an accepted draft: its KV was computed, the rest of the run's was not kept.
            seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)
            if seq.is_finished and self.on_finish is not None:
                self.on_finish(seq)
            elif drafted and not seq.is_finished:
                self._verified_boundary(seq, batch_id)
            if first or seq.is_finished:
                updates.append(request_update(seq, with_token=True))
        self.generation_tokens += len(tokens)

    def _swap_state_slot(self, seq: Sequence, num_accepted: int) -> None:
        """Hybrid models: the state after the last accepted token is in slot `num_accepted` of
        the sequence's slots; make it the committed one (slot 0)."""
        if num_accepted and seq.state_slots:
            slots = seq.state_slots
            slots[0], slots[num_accepted] = slots[num_accepted], slots[0]

    def _verified_boundary(self, seq: Sequence, batch_id: int | None) -> None:
        """Hybrid models with checkpoints: a verify step's committed state may land on a decode
        boundary only once its acceptance is known (a boundary it stepped over without landing
        on is not placed). Staged like a boundary reached on an in-flight token: the committed
        slot holds that state until the next batch, which copies it out before its forward."""
        ck = self.checkpoints
        if ck is None or batch_id is None:
            return
        computed = seq.num_computed_tokens
        end = seq.known_end(self.max_model_len)
        boundary = ck.placement.decode_boundary(
            seq.request_id, computed, None if end is None else end - 1
        )
        if boundary is not None:
            self._deferred_boundaries.append((seq, boundary[0], boundary[1], batch_id))

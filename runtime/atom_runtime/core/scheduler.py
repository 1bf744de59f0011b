"""Scheduler: continuous batching under a token budget, with chunked prefill and preemption.

Each step it spends `max_num_batched_tokens` on, in order: the running sequences (one token for a
decode, the next chunk for a prompt still being prefilled), then waiting sequences, admitted while
the budget, `max_num_seqs` and free blocks last. A long prompt is cut into chunks that share the
budget with decodes instead of stalling them. When blocks run out, the sequence at the tail of the
running queue is preempted by recompute: its blocks are freed and it goes back to the head of the
waiting queue. For hybrid models a sequence also needs a state slot (`StateSlotPool`) to be
admitted; it waits, like one short of blocks, until a running sequence returns one (finishing,
aborting or being preempted). The scheduler never touches tensors.

After the model ran a step, `update_from_output` takes what it sampled (read back to the host):
each token fills its sequence's pending slot, stop conditions are checked (`check_stop`), the
step's computed blocks are published and finished sequences are freed. With async scheduling
that happens one step late: the next step was scheduled, with a pending token in each sampled
sequence's place, before this one's samples came back.

Hybrid models with state checkpoints (`EngineCheckpoints`, docs/state-checkpoints.md): a waiting
sequence resumes from the deepest READY checkpoint at or below its KV prefix hit (pinned at
once; only that many hit blocks are claimed) and its slot gets a queued restore; prefill chunks
are cut to land on the placement policy's boundaries, each boundary reached is staged as a
store; and every batch carries the unit table of the copies it must run before its forward
(`ScheduledBatch.state_copy`). `update_from_output` settles the batch (publication, unpinning,
slots held by copies coming back).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from atom_runtime.core.batch import ScheduledBatch, StepOutput
from atom_runtime.core.block_manager import BlockManager
from atom_runtime.core.sequence import FinishReason, Sequence, SequenceStatus
from atom_runtime.core.spec_schedule import SpeculativeSteps
from atom_runtime.protocol.engine_core import RequestUpdate, StepOutputs
from atom_runtime.protocol.spec_decode_stats import SpecDecodingStats
from atom_runtime.state.chains import CheckpointChains
from atom_runtime.state.checkpoint_record import CheckpointHit
from atom_runtime.state.engine_checkpoints import EngineCheckpoints
from atom_runtime.state.slot_pool import StateSlotPool


class Scheduler(SpeculativeSteps):
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: list[int],
        state_pool: StateSlotPool | None = None,
        checkpoints: EngineCheckpoints | None = None,
        num_speculative_tokens: int = 0,
        spec_lookahead: int = 0,
    ) -> None:
        self.block_manager = block_manager
        # Speculative decoding (core/spec_schedule.py): k drafts a step at most, and the slots a
        # drafting model writes past a step's tokens.
        if num_speculative_tokens:
            self.num_speculative_tokens = num_speculative_tokens
            self.spec_lookahead = spec_lookahead
            self.spec_stats = SpecDecodingStats(num_speculative_tokens)
        self.state_pool = state_pool
        if checkpoints is not None and state_pool is None:
            raise ValueError("checkpoints: state checkpoints need a state slot pool")
        self.checkpoints = checkpoints
        self.batch_id = 0
        # (seq, position, reason, batch that reached it): boundaries staged one schedule late.
        self._deferred_boundaries: list[tuple[Sequence, int, str | None, int]] = []
        # Which checkpoints of a conversation a newer one supersedes (`state/chains.py`).
        self._chains = CheckpointChains()
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids  # the engine's list: stop tokens unless ignore_eos
        self.requests: dict[str, Sequence] = {}  # every unfinished sequence, by request id
        # Called with each sequence a step finishes, before its blocks are freed and its output
        # is built (a KV-transfer producer holds the prompt's blocks and sets kv_transfer_reply).
        self.on_finish: Callable[[Sequence], None] | None = None
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Prefix-cache counters, in prompt tokens, over every admission.
        self.prefix_queries = 0
        self.prefix_hits = 0
        # Cumulative prompt tokens computed and tokens generated.
        self.prompt_tokens = 0
        self.generation_tokens = 0

    def add(self, seq: Sequence) -> None:
        self.requests[seq.request_id] = seq
        self.waiting.append(seq)

    def reset_counters(self) -> None:
        """Zero the token counters (after the engine's warm-up request)."""
        self.prefix_queries = self.prefix_hits = 0
        self.prompt_tokens = self.generation_tokens = 0
        if self.spec_stats is not None:
            self.spec_stats.reset()

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        boundaries: list[tuple[Sequence, tuple[int, str | None]]] = []
        # 1. Running sequences: decodes and unfinished prompt chunks, oldest first.
        budget = self._schedule_running(batch, self.max_num_batched_tokens, boundaries)
        # 2. Waiting sequences, while budget, sequence slots and blocks last. No preemption here:
        # admitting new work never evicts running work.
        if batch.num_preempted == 0:
            self._admit_waiting(batch, budget, boundaries)
        if self.checkpoints is not None:
            self._take_maintenance(batch, boundaries)
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int, boundaries: list) -> int:
        """Put the running sequences that have work into `batch`, oldest first, preempting the
        newest when blocks run out; returns the token budget left."""
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if self._sits_out(seq):
                i += 1
                continue
            num_new, boundary = self._plan(seq, budget)
            drafts = self._drafts_for(seq, num_new, budget) if self.num_speculative_tokens else []
            while not self._allocate_step(seq, num_new, drafts):
                victim = self.running.pop(self._victim_index(i))
                self._preempt(victim)
                batch.num_preempted += 1
                if victim is seq:
                    break
            else:
                num_new += seq.num_spec
                batch.seqs.append(seq)
                batch.num_new_tokens.append(num_new)
                budget -= num_new
                i += 1
                # A verify step's boundary is known once its acceptance is (`_apply_verified`).
                if boundary is not None and not seq.num_spec:
                    boundaries.append((seq, boundary))
        return budget

    def _sits_out(self, seq: Sequence) -> bool:
        """Whether seq's next step waits on its step in flight (async scheduling): its last
        token is being sampled; its next step reads that token (penalties, a grammar's mask);
        or it speculates (core/spec_schedule.py)."""
        if seq.final_pending or (seq.needs_token_history and seq.num_pending):
            return True
        return bool(self.num_speculative_tokens and seq.steps_in_flight)

    def _admit_waiting(self, batch: ScheduledBatch, budget: int, boundaries: list) -> None:
        """Admit waiting sequences into `batch` in arrival order while the budget, the
        sequence slots, the state slots and the blocks last."""
        ck = self.checkpoints
        bs = self.block_manager.block_size
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self.state_pool is not None and not self.state_pool.can_allocate():
                break  # every slot is held by a running sequence: wait for one to leave
            hit = self.block_manager.find_prefix_hit(seq)
            resume, found = self._resume_point(seq, hit, budget)
            num_cached = len(resume) * bs
            num_new = min(seq.num_tokens - num_cached, budget)
            if not self._allocate_step(seq, num_new, [], resume):
                if found is not None:
                    ck.store.release(found.ref)
                break
            self.waiting.popleft()
            if self.state_pool is not None:
                self.state_pool.allocate(seq)
            boundary = None
            if ck is not None:
                ck.placement.note_admission(seq.request_id, len(hit) * bs, num_cached)
                if found is not None:
                    ck.maint.queue_restore(seq.request_id, seq.state_slots[0], found)
                    self._chains.resumed(seq.request_id, found.ref, ck.store.from_decode(found.ref))
                # The allocation covered the uncut chunk; a cut only shortens it.
                num_new, boundary = self._plan(seq, budget)
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.time()
                seq.num_cached_tokens = num_cached
                self.prefix_queries += seq.num_prompt_tokens
                self.prefix_hits += num_cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
            if boundary is not None:
                boundaries.append((seq, boundary))

    def _resume_point(
        self, seq: Sequence, hit: list, budget: int
    ) -> tuple[list, CheckpointHit | None]:
        """The cached blocks a waiting sequence starts from, and the state checkpoint it
        resumes (acquired; None without one). A hybrid model resumes only where its recurrent
        state was saved: the deepest READY checkpoint at or below the KV hit, pinned before
        allocating (which may reclaim checkpoints). A request that cannot run beside the image
        it would pin would wait for ever for blocks only its own pin holds: it recomputes."""
        ck = self.checkpoints
        if ck is None:
            return hit, None
        found = ck.store.lookup(seq.block_hashes, len(hit))
        if found is not None and not self._fits_beside(seq, found.num_tokens, budget):
            found = None
        if found is None:
            return [], None
        ck.store.acquire(found.ref)
        return hit[: found.num_tokens // self.block_manager.block_size], found

    # -- state checkpoints ---------------------------------------------------------------------

    def _plan(self, seq: Sequence, budget: int) -> tuple[int, tuple[int, str | None] | None]:
        """Tokens to run for seq this step and the checkpoint boundary (position, reason) the
        step brings it to, if any: prefill chunks are cut to land on the placement's
        boundaries; a decode may reach a ladder rung."""
        remaining = seq.num_tokens - seq.num_computed_tokens
        ck = self.checkpoints
        if ck is None:
            return min(remaining, budget), None
        computed = seq.num_computed_tokens
        if computed >= seq.num_prompt_tokens and remaining == 1:
            # The last token of a known end is sampled, never run: state reaches end - 1.
            end = seq.known_end(self.max_model_len)
            last = None if end is None else end - 1
            return 1, ck.placement.decode_boundary(seq.request_id, computed + 1, last)
        plan = ck.placement.plan_prefill_chunk(
            seq.request_id, computed, seq.num_tokens, budget, prompt_len=seq.num_prompt_tokens
        )
        return plan.num_tokens, (None if plan.boundary is None else (plan.boundary, plan.reason))

    def _allocate(self, seq: Sequence, num_new: int, hit: list[int] = ()) -> bool:
        """Allocate KV for seq; short of blocks, checkpoints give theirs back first (live KV
        comes first), then one more try."""
        bm = self.block_manager
        if bm.allocate(seq, num_new, hit):
            return True
        if self.checkpoints is None:
            return False
        computed = len(hit) * bm.block_size if hit else seq.num_computed_tokens
        short = bm.blocks_needed(computed + num_new) - len(seq.block_table)
        if self.checkpoints.store.reclaim(max(short, 1)) == 0:
            return False
        return bm.allocate(seq, num_new, hit)

    def _fits_beside(self, seq: Sequence, resume_tokens: int, budget: int) -> bool:
        """Whether seq's KV fits in the pool beside one checkpoint image for as long as its
        restore pins that image: until the restore's batch has run, that is through this chunk
        and, under async scheduling, the next one (or the first decode, +1)."""
        bm = self.block_manager
        reach = min(seq.num_tokens + 1, resume_tokens + budget + self.max_num_batched_tokens)
        units = self.checkpoints.spec.units_per_image
        return bm.blocks_needed(reach) + units <= bm.pool.num_blocks

    def _take_maintenance(
        self, batch: ScheduledBatch, boundaries: list[tuple[Sequence, tuple[int, str | None]]]
    ) -> None:
        """Stage the boundaries this batch reaches (their copies ride the next real batch) and
        drain the copies this batch carries into its unit table."""
        ck = self.checkpoints
        bm = self.block_manager
        self.batch_id += 1
        b = self.batch_id
        ready = []
        # Boundaries the previous batch reached on a token that was still being sampled (async
        # scheduling: a decode's input token). That token has been read back since, so the
        # block's hash is known; the slot still holds the state at the boundary, because no
        # batch after the one that reached it has run the sequence yet (this one copies first).
        # A sequence that finished, was preempted or is still waiting on the token loses it.
        for seq, pos, reason, reached in self._deferred_boundaries:
            if (
                seq.status is SequenceStatus.RUNNING
                and seq.num_computed_tokens >= pos
                and pos <= seq.num_tokens - seq.num_pending
            ):
                ready.append((seq, pos, reason, reached))
            else:
                ck.counters.dropped += 1
        self._deferred_boundaries = []
        for seq, (pos, reason) in boundaries:
            if pos > seq.num_tokens - seq.num_pending:
                self._deferred_boundaries.append((seq, pos, reason, b))
            else:
                ready.append((seq, pos, reason, b))
        for seq, pos, reason, reached in ready:
            bm.ensure_hashes(seq, pos // bm.block_size)
            staged = ck.store.stage(
                seq.block_hashes[pos // bm.block_size - 1],
                pos,
                demand=reason == "demand",
                rolling=reason == "decode_anchor",
            )
            if staged is None:
                continue
            ck.maint.queue_store(seq.request_id, seq.state_slots[0], staged, after_batch=reached)
            self._chains.staged(seq.request_id, reason, staged.ref)
        flush = not batch and ck.maint.needs_flush
        ops = ck.maint.take_for_batch(b, len(batch.seqs), flush=flush)
        batch.batch_id = b
        if ops:
            batch.state_copy = ops.unit_table(ck.spec, bm.pool.num_blocks, ck.num_slots).rows

    def flush_checkpoint_copies(self) -> ScheduledBatch | None:
        """Copies queued for requests that have ended (their slots are held for them), taken
        alone, before the next schedule: run them (`executor.copy_state`) and settle the batch,
        and the checkpoints they fill are READY when the next admission looks, not one batch
        later (a conversation's next turn resumes where the answer ended). None: none queued."""
        ck = self.checkpoints
        if ck is None or not ck.maint.needs_flush:
            return None
        self.batch_id += 1
        batch = ScheduledBatch(batch_id=self.batch_id)
        ops = ck.maint.take_for_batch(self.batch_id, 0, flush=True)
        if ops:
            pool = self.block_manager.pool
            batch.state_copy = ops.unit_table(ck.spec, pool.num_blocks, ck.num_slots).rows
        return batch

    def batch_done(self, batch: ScheduledBatch) -> None:
        """batch has run (its outputs were read back): publish the checkpoints its copies
        filled, unpin its restores' sources, take back slots that only its copies held."""
        if self.checkpoints is None or batch.batch_id is None:
            return
        store = self.checkpoints.store
        outcome = self.checkpoints.maint.batch_done(batch.batch_id)
        for older in self._chains.published(outcome.published):
            store.supersede(older)
        self._chains.prune(lambda ref: store.state_of(ref) is not None)
        if outcome.released_slots:
            self.state_pool.give_back(outcome.released_slots)

    def commit(self, batch: ScheduledBatch, samplers: list[Sequence]) -> None:
        """The batch is on its way to the device: its tokens count as computed from here on (the
        next schedule may run while this step is still in flight), and each sequence sampling
        in it holds a pending token until `update_from_output` fills it in."""
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                self.prompt_tokens += min(num_new, seq.num_prompt_tokens - seq.num_computed_tokens)
            seq.num_computed_tokens += num_new
            seq.steps_in_flight += 1
        for seq in samplers:
            seq.append_pending(self.max_model_len)

    def update_from_output(
        self, batch: ScheduledBatch, output: StepOutput | None
    ) -> tuple[StepOutputs, list[Sequence]]:
        """Apply a completed step: fill in its sampled tokens, check stops, publish the blocks it
        computed and free the sequences that finished. Sequences finished since the step was
        launched (an abort, or a stop found by the step before) are skipped: their row was
        wasted. Returns the step's outputs (a row per token; an update with each sequence's
        first token and with its finish) and the sequences it finished."""
        for seq in batch.seqs:
            seq.steps_in_flight -= 1
        live = [seq for seq in batch.seqs if not seq.is_finished]
        outputs = StepOutputs()
        if output is not None and output.num_tokens is not None:
            self._apply_verified(batch.batch_id, output, outputs)
        elif output is not None:
            now = time.time()
            ids, tokens, updates = outputs.request_ids, outputs.token_ids, outputs.updates
            with_logprobs = output.logprobs is not None
            if with_logprobs:
                outputs.logprobs, outputs.top_ids, outputs.top_logprobs = [], [], []
            for row, seq in enumerate(output.samplers):
                if seq.is_finished:
                    continue
                token = output.token_ids[row]
                seq.resolve_pending(token)
                if seq.matcher is not None:
                    seq.matcher.consume_token(token)
                first = seq.first_token_time is None
                if first:
                    seq.first_token_time = now
                check_stop(seq, token, self.eos_token_ids, self.max_model_len)
                if seq.is_finished and self.on_finish is not None:
                    self.on_finish(seq)
                ids.append(seq.request_id)
                tokens.append(token)
                if with_logprobs:
                    output.add_logprobs(outputs, row, seq.sampling_params.logprobs)
                if first or seq.is_finished:
                    updates.append(request_update(seq, with_token=True))
            self.generation_tokens += len(tokens)
        finished = self._finish_step(live)
        self.batch_done(batch)
        return outputs, finished

    def _finish_step(self, seqs: list[Sequence]) -> list[Sequence]:
        """For a step's sequences that were still live when it completed: publish newly computed
        blocks and retire the finished ones. A sequence preempted while its step was in flight
        may finish from the waiting queue."""
        for seq in seqs:
            self.block_manager.publish_computed_blocks(seq)
        finished = [seq for seq in seqs if seq.is_finished]
        if finished:
            for seq in finished:
                self._release(seq)
                self.requests.pop(seq.request_id, None)
            self.running = [seq for seq in self.running if not seq.is_finished]
            if any(seq.status is SequenceStatus.FINISHED for seq in self.waiting):
                self.waiting = deque(seq for seq in self.waiting if not seq.is_finished)
        return finished

    def abort(self, request_ids: set[str]) -> list[Sequence]:
        """Abort sequences wherever they are, freeing every block they hold."""
        aborted = []
        for queue in (self.waiting, self.running):
            for seq in list(queue):
                if seq.request_id in request_ids:
                    queue.remove(seq)
                    self._release(seq)
                    seq.finish(FinishReason.ABORT)
                    aborted.append(seq)
        for seq in aborted:
            self.requests.pop(seq.request_id, None)
        return aborted

    def _release(self, seq: Sequence) -> None:
        """Give back everything a sequence holds: blocks, state slots, checkpoint pins (a
        restore still queued for it is cancelled) and its pending boundary. A slot a queued
        checkpoint copy still reads stays held until that copy has run (`batch_done`)."""
        self.block_manager.free(seq)
        if self.state_pool is None:
            return
        ck = self.checkpoints
        if ck is None:
            self.state_pool.free(seq)
            return
        slot = seq.state_slots[0] if seq.state_slots else None
        self._chains.forget(seq.request_id)
        released = ck.maint.free_request(seq.request_id, slot)
        ck.placement.forget(seq.request_id)
        hold = {slot} if slot is not None and slot not in released else set()
        self.state_pool.free(seq, hold)
        others = [s for s in released if s != slot]
        if others:
            self.state_pool.give_back(others)

    def _preempt(self, seq: Sequence) -> None:
        # Recompute from scratch: its slot goes back too (the state is rebuilt from token 0).
        self._release(seq)
        seq.spec_token_ids = []  # proposed again once it decodes
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)


def check_stop(seq: Sequence, token: int, eos_token_ids: list[int], max_model_len: int) -> None:
    """Finish `seq` if the token just filled in ends it: its grammar completed (or broke), EOS
    (unless ignore_eos) or a stop token id once min_tokens is reached, max_tokens, or the context
    length. Tokens still pending after it (sampled by a later step in flight) do not count."""
    p = seq.sampling_params
    num_output = seq.num_output_tokens - seq.num_pending
    if seq.matcher is not None and (seq.matcher.is_stopped() or seq.matcher.is_error()):
        # The grammar is complete (or the token broke it: a stop-id edit, say): done.
        seq.finish(FinishReason.STOP)
        return
    if num_output >= p.min_tokens:
        if not p.ignore_eos and token in eos_token_ids:
            seq.finish(FinishReason.STOP)
            return
        if p.stop_token_ids and token in p.stop_token_ids:
            seq.finish(FinishReason.STOP, token)
            return
    if p.max_tokens is not None and num_output >= p.max_tokens:
        seq.finish(FinishReason.LENGTH)
    elif seq.num_tokens - seq.num_pending >= max_model_len:
        seq.finish(FinishReason.LENGTH)


def request_update(seq: Sequence, with_token: bool) -> RequestUpdate:
    """What the frontend hears about `seq` besides its tokens: its prompt and timestamps, its
    finish once finished, and with its first token (`with_token`) the prompt's logprobs when it
    asked for them."""
    out = RequestUpdate(
        request_id=seq.request_id,
        finish_reason=seq.finish_reason.value if seq.finish_reason else None,
        stop_reason=seq.stop_reason,
        num_prompt_tokens=seq.num_prompt_tokens,
        num_cached_tokens=seq.num_cached_tokens,
        first_scheduled_time=seq.first_scheduled_time,
        first_token_time=seq.first_token_time,
        num_preemptions=seq.num_preemptions,
        kv_transfer_params=seq.kv_transfer_reply if seq.finish_reason else None,
    )
    if seq.sampling_params.prompt_logprobs is not None and with_token and not seq.prompt_lp_sent:
        seq.prompt_lp_sent = True
        out.prompt_logprobs = [lp for lp, _, _, _ in seq.prompt_lp]
        out.prompt_top_ids = [ids for _, ids, _, _ in seq.prompt_lp]
        out.prompt_top_logprobs = [lps for _, _, lps, _ in seq.prompt_lp]
        out.prompt_ranks = [rank for _, _, _, rank in seq.prompt_lp]
    return out

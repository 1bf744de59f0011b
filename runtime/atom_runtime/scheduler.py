"""Scheduler: continuous batching under a token budget, with chunked prefill and preemption.

Each step it spends `max_num_batched_tokens` on, in order: the running sequences (one token for a
decode, the next chunk for a prompt still being prefilled), then waiting sequences, admitted while
the budget, `max_num_seqs` and free blocks last. A long prompt is cut into chunks that share the
budget with decodes instead of stalling them. When blocks run out, the sequence at the tail of the
running queue is preempted by recompute: its blocks are freed and it goes back to the head of the
waiting queue. For hybrid models a sequence also needs a state slot (`StateSlotPool`) to be
admitted; it waits, like one short of blocks, until a running sequence returns one (finishing,
aborting or being preempted). The scheduler never touches tensors.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from atom_runtime.block_manager import BlockManager
from atom_runtime.sequence import FinishReason, Sequence, SequenceStatus
from atom_runtime.state.slot_pool import StateSlotPool


@dataclass
class ScheduledBatch:
    """What one step computes: for each sequence, how many of its tokens to run."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_preempted: int = 0

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        state_pool: StateSlotPool | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.state_pool = state_pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Prefix-cache counters, in prompt tokens, over every admission.
        self.prefix_queries = 0
        self.prefix_hits = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens

        # 1. Running sequences: decodes and unfinished prompt chunks, oldest first.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.final_pending or (seq.needs_token_history and seq.num_pending):
                # Its last token is being sampled right now, or its next step needs the token
                # still in flight (penalties, a grammar's mask): nothing to run this step.
                i += 1
                continue
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.block_manager.allocate(seq, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                batch.num_preempted += 1
                if victim is seq:
                    break
            else:
                batch.seqs.append(seq)
                batch.num_new_tokens.append(num_new)
                budget -= num_new
                i += 1

        # 2. Waiting sequences, while budget, sequence slots and blocks last. No preemption here:
        # admitting new work never evicts running work.
        if batch.num_preempted == 0:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                if self.state_pool is not None and not self.state_pool.can_allocate():
                    break  # every slot is held by a running sequence: wait for one to leave
                hit = self.block_manager.find_prefix_hit(seq)
                num_cached = len(hit) * self.block_manager.block_size
                num_new = min(seq.num_tokens - num_cached, budget)
                if not self.block_manager.allocate(seq, num_new, hit):
                    break
                self.waiting.popleft()
                if self.state_pool is not None:
                    self.state_pool.allocate(seq)
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
        return batch

    def commit(self, batch: ScheduledBatch) -> None:
        """The batch is on its way to the device: its tokens count as computed from here on (the
        next schedule may run while this step is still in flight)."""
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed_tokens += num_new

    def finish_step(self, seqs: list[Sequence]) -> list[Sequence]:
        """After a step's samples are appended and finish reasons set, for the step's sequences
        that were still live when it completed: publish newly computed blocks and retire the
        finished ones. A sequence preempted while its step was in flight may finish from the
        waiting queue."""
        for seq in seqs:
            self.block_manager.publish_computed_blocks(seq)
        finished = [seq for seq in seqs if seq.is_finished]
        if finished:
            for seq in finished:
                self._release(seq)
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
        return aborted

    def _release(self, seq: Sequence) -> None:
        """Give back everything a sequence holds: blocks and state slots."""
        self.block_manager.free(seq)
        if self.state_pool is not None:
            self.state_pool.free(seq)

    def _preempt(self, seq: Sequence) -> None:
        # Recompute from scratch: its slot goes back too (the state is rebuilt from token 0).
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

"""Randomized run of the checkpoint system against a real BlockPool/BlockManager (contract 6):
arrivals (fresh, sharing system prompts, extending finished conversations), aborts, preemptions,
KV pressure (reclaim), prefix-cache resets and batches, some settled a batch late (async
scheduling). After every step the store's invariants, the pins, the slots and the KV blocks are
checked; the run ends with zero borrowed units, zero pins and every slot back.

The model is simulated: a slot's state is a deterministic recurrence over the tokens computed so
far, written into real tensors that the torch reference executor copies in and out of the pool's
bytes. So a request resumed from a checkpoint must reach exactly the state recomputing gives; a
wrong resume depth, unit or stale record shows up as a state mismatch.
"""

from __future__ import annotations

import random

import pytest
import torch

from atom_runtime.core.block_manager import BlockManager
from atom_runtime.core.block_pool import BlockPool
from atom_runtime.core.sequence import Sequence
from atom_runtime.protocol.block_hash import hash_token_blocks
from atom_runtime.protocol.checkpoint_counters import StateCheckpointCounters
from atom_runtime.sampling_params import SamplingParams
from atom_runtime.state.checkpoint_spec import PagedStateCheckpointSpec
from atom_runtime.state.checkpoint_store import StateCheckpointStore
from atom_runtime.state.maintenance import StateMaintenance, copy_units_reference, uint8_rows
from atom_runtime.state.placement import CheckpointPlacement

BS = 4
NUM_BLOCKS = 64
NUM_SLOTS = 10
MAX_SEQS = 6
BUDGET = 24


def _advance(s64: torch.Tensor, s32: torch.Tensor, tokens) -> None:
    """The simulated recurrent state update, one token at a time (order matters, as in a model)."""
    mul64 = torch.arange(3, 6, dtype=torch.int64)
    mul32 = torch.arange(1, 6, dtype=torch.int32)
    for t in tokens:
        s64.mul_(mul64).add_(t + 1).remainder_(1 << 31)
        s32.mul_(7).add_(mul32 * t).remainder_(1 << 20)


def _reference(tokens) -> tuple[torch.Tensor, torch.Tensor]:
    s64, s32 = torch.zeros(3, dtype=torch.int64), torch.zeros(5, dtype=torch.int32)
    _advance(s64, s32, tokens)
    return s64, s32


class Sim:
    def __init__(self, seed: int, interval: int, async_done: bool) -> None:
        self.rng = random.Random(seed)
        self.async_done = async_done
        # KV pool: two 16-byte segments a block (think K and V) -> 32-byte units. Slot image:
        # int64[3] + int32[5] = 44 bytes -> 2 units, the second one partly padding.
        self.kv = [torch.zeros((NUM_BLOCKS, 16), dtype=torch.uint8) for _ in range(2)]
        self.s64 = torch.zeros((NUM_SLOTS, 3), dtype=torch.int64)
        self.s32 = torch.zeros((NUM_SLOTS, 5), dtype=torch.int32)
        self.spec = PagedStateCheckpointSpec(32, 44, 44, "sim")
        self.pool = BlockPool(NUM_BLOCKS, BS)
        self.manager = BlockManager(self.pool)
        self.counters = StateCheckpointCounters()
        self.store = StateCheckpointStore(
            self.pool, self.spec, max_units=16, min_free_blocks=4, counters=self.counters
        )
        self.maint = StateMaintenance(self.store)
        self.placement = CheckpointPlacement(
            interval, BS, demand=True, counters=self.counters, environ={}
        )
        self.free_slots = list(range(NUM_SLOTS))
        self.slot_of: dict[str, int] = {}
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.finished_tokens: list[list[int]] = []
        self.system_prompts = [[self.rng.randrange(1000) for _ in range(n)] for n in (9, 22, 37)]
        self.batch_id = 0
        self.rolling: dict[str, object] = {}  # request id -> its latest decode anchor
        self.undone: list[int] = []
        self.next_id = 0
        self.restores_checked = 0

    # -- events --------------------------------------------------------------------------------

    def arrive(self) -> None:
        r = self.rng.random()
        if r < 0.4 and self.finished_tokens:
            prompt = list(self.rng.choice(self.finished_tokens))  # the next turn
        elif r < 0.8:
            prompt = list(self.rng.choice(self.system_prompts))
        else:
            prompt = []
        prompt += [self.rng.randrange(1000) for _ in range(self.rng.randint(1, 12))]
        seq = Sequence(
            f"r{self.next_id}", prompt, SamplingParams(max_tokens=self.rng.randint(1, 10))
        )
        self.next_id += 1
        self.waiting.append(seq)

    def release(self, seq: Sequence) -> None:
        """Finished, aborted or preempted: blocks, slot, pending boundary."""
        self.manager.free(seq)
        slot = self.slot_of.pop(seq.request_id, None)
        self.free_slots += self.maint.free_request(seq.request_id, slot)
        self.placement.forget(seq.request_id)
        self.rolling.pop(seq.request_id, None)

    def abort(self) -> None:
        pool = self.waiting + self.running
        if not pool:
            return
        seq = self.rng.choice(pool)
        if seq in self.running:
            self.running.remove(seq)
            self.release(seq)
        else:
            self.waiting.remove(seq)

    def preempt(self) -> None:
        if not self.running:
            return
        seq = self.rng.choice(self.running)
        self.running.remove(seq)
        self.release(seq)
        seq.num_computed_tokens = 0
        self.waiting.insert(0, seq)

    # -- one engine step -----------------------------------------------------------------------

    def allocate(self, seq: Sequence, n: int, hit=()) -> bool:
        if self.manager.allocate(seq, n, list(hit)):
            return True
        # Live KV first: checkpoints give their blocks back, then we try once more.
        self.store.reclaim(self.manager.blocks_needed(seq.num_computed_tokens + n) + len(hit))
        return self.manager.allocate(seq, n, list(hit))

    def plan(self, seq: Sequence, budget: int):
        computed = seq.num_computed_tokens
        if computed >= seq.num_prompt_tokens and seq.num_tokens - computed == 1:
            return 1, self.placement.decode_boundary(seq.request_id, computed + 1)  # (pos, why)
        plan = self.placement.plan_prefill_chunk(
            seq.request_id, computed, seq.num_tokens, budget, prompt_len=seq.num_prompt_tokens
        )
        return plan.num_tokens, (None if plan.boundary is None else (plan.boundary, plan.reason))

    def step(self) -> None:
        self.batch_id += 1
        batch: list[tuple[Sequence, int, int | None]] = []
        budget = BUDGET
        for seq in list(self.running):
            if budget <= 0:
                break
            n, boundary = self.plan(seq, budget)
            if not self.allocate(seq, n):
                self.running.remove(seq)
                self.release(seq)
                seq.num_computed_tokens = 0
                self.waiting.insert(0, seq)
                continue
            batch.append((seq, n, boundary))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < MAX_SEQS and self.free_slots:
            seq = self.waiting[0]
            kv_hit = self.manager.find_prefix_hit(seq)
            found = self.store.lookup(seq.block_hashes, len(kv_hit))
            if found:  # pin before allocating: allocation may reclaim checkpoints
                self.store.acquire(found.ref)
            resume_blocks = found.num_tokens // BS if found else 0
            seq.num_computed_tokens = resume_blocks * BS
            n, boundary = self.plan(seq, budget)
            if not self.allocate(seq, n, kv_hit[:resume_blocks]):
                seq.num_computed_tokens = 0
                if found:
                    self.store.release(found.ref)
                break
            self.waiting.pop(0)
            slot = self.free_slots.pop(self.rng.randrange(len(self.free_slots)))
            self.slot_of[seq.request_id] = slot
            self.placement.note_admission(seq.request_id, len(kv_hit) * BS, resume_blocks * BS)
            if found:
                self.maint.queue_restore(seq.request_id, slot, found)
            self.running.append(seq)
            batch.append((seq, n, boundary))
            budget -= n

        flush = not batch and self.maint.needs_flush
        ops = self.maint.take_for_batch(self.batch_id, len(batch), flush=flush)
        if ops:
            table = ops.unit_table(self.spec, NUM_BLOCKS, NUM_SLOTS)
            copy_units_reference(
                table,
                [uint8_rows(t) for t in self.kv],
                [uint8_rows(self.s64), uint8_rows(self.s32)],
                self.spec,
            )
            by_id = {s.request_id: s for s, _, _ in batch}
            for op in ops.restores:
                seq = by_id.get(op.seq_id)
                if seq is not None:  # restored state == recomputing the prefix
                    want64, want32 = _reference(seq.token_ids[: seq.num_computed_tokens])
                    assert torch.equal(self.s64[op.slot], want64)
                    assert torch.equal(self.s32[op.slot], want32)
                    self.restores_checked += 1

        # The forward pass.
        for seq, n, _ in batch:
            slot = self.slot_of[seq.request_id]
            start = seq.num_computed_tokens
            if start == 0:  # no initial state: start from zeros, whatever the slot held
                self.s64[slot].zero_()
                self.s32[slot].zero_()
            _advance(self.s64[slot], self.s32[slot], seq.token_ids[start : start + n])
            seq.num_computed_tokens += n
            want64, want32 = _reference(seq.token_ids[: seq.num_computed_tokens])
            assert torch.equal(self.s64[slot], want64), seq.request_id
            assert torch.equal(self.s32[slot], want32), seq.request_id

        # Boundaries reached this batch: stage; the copy rides the next real batch.
        for seq, _, boundary in batch:
            if boundary is None:
                continue
            pos, reason = boundary
            prefix_hash = hash_token_blocks(seq.token_ids[:pos], BS)[-1]
            staged = self.store.stage(prefix_hash, pos)
            if staged is None:
                continue
            self.maint.queue_store(
                seq.request_id, self.slot_of[seq.request_id], staged, self.batch_id
            )
            if reason in ("decode_anchor", "rung"):  # the scheduler's rolling decode anchors
                previous = self.rolling.pop(seq.request_id, None)
                if previous is not None:
                    self.store.supersede(previous)
                if reason == "decode_anchor":
                    self.rolling[seq.request_id] = staged.ref

        # Sample, publish KV, retire finished sequences.
        for seq, _, _ in batch:
            if seq.num_computed_tokens == seq.num_tokens:
                seq.append_pending(1 << 30)
                seq.resolve_pending(self.rng.randrange(1000))
            self.manager.publish_computed_blocks(seq)
            if seq.num_output_tokens >= seq.sampling_params.max_tokens:
                self.running.remove(seq)
                self.release(seq)
                self.finished_tokens.append(list(seq.token_ids))

        self.undone.append(self.batch_id)
        keep = 1 if self.async_done and self.rng.random() < 0.5 else 0
        while len(self.undone) > keep:
            self.free_slots += self.maint.batch_done(self.undone.pop(0)).released_slots

    # -- invariants ----------------------------------------------------------------------------

    def check(self) -> None:
        self.store.check_invariants()
        assert self.store.total_pins == self.maint.num_outstanding_restores
        owned = list(self.slot_of.values())
        held = self.maint.held_slots
        assert len(set(self.free_slots)) == len(self.free_slots)
        assert sorted(self.free_slots + owned + sorted(held)) == list(range(NUM_SLOTS))
        seq_blocks = {b for s in self.running for b in s.block_table}
        lent = set(self.pool.lent)
        assert not seq_blocks & lent
        in_use = {b.block_id for b in self.pool.blocks if b.ref_count > 0}
        assert in_use == seq_blocks | lent
        assert not any(s.block_table for s in self.waiting)

    def drain(self) -> None:
        for seq in list(self.running):
            self.running.remove(seq)
            self.release(seq)
        self.waiting.clear()
        for _ in range(10):
            if self.store.invalidate_all() and not self.maint.held_slots and not self.undone:
                break
            self.step()  # nothing to schedule: a flush carries what holds slots
            self.check()


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("interval", [-1, 8, 14])
def test_random_traffic_keeps_every_invariant_and_ends_with_nothing_borrowed(seed, interval):
    sim = Sim(seed, interval, async_done=seed % 2 == 1)
    rng = sim.rng
    for _ in range(250):
        r = rng.random()
        if r < 0.35:
            sim.arrive()
        elif r < 0.40:
            sim.abort()
        elif r < 0.45:
            sim.preempt()
        elif r < 0.50:
            sim.store.reclaim(rng.randint(1, 8))
        elif r < 0.51:
            sim.store.invalidate_all()
        sim.check()
        sim.step()
        sim.check()
    sim.drain()
    assert sim.store.units_in_use == 0 and not sim.pool.lent
    assert sim.store.total_pins == 0
    assert sorted(sim.free_slots) == list(range(NUM_SLOTS))
    assert sim.pool.num_free_blocks == NUM_BLOCKS
    c = sim.counters
    # The run exercised the paths it claims to check.
    assert c.stored > 0 and c.restored > 0 and sim.restores_checked > 0
    assert c.prefix_hit_tokens > 0

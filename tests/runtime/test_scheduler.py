"""Scheduler invariants: budgets, chunked prefill, preemption from the tail, aborts anywhere, and
no block leaked after any workload."""

from __future__ import annotations

import random

from atom_runtime.block_manager import BlockManager
from atom_runtime.block_pool import BlockPool
from atom_runtime.sampling_params import SamplingParams
from atom_runtime.scheduler import Scheduler
from atom_runtime.sequence import FinishReason, Sequence, SequenceStatus


def _scheduler(num_blocks=16, block_size=4, max_num_seqs=4, budget=16) -> Scheduler:
    return Scheduler(BlockManager(BlockPool(num_blocks, block_size)), max_num_seqs, budget)


def _run_step(s: Scheduler, rng: random.Random | None = None):
    """Schedule, then play the model: sequences whose chunk reached their end get a token."""
    batch = s.schedule()
    sampling = [
        seq.num_computed_tokens + n == seq.num_tokens
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
    ]
    s.commit(batch)
    for seq, samples in zip(batch.seqs, sampling, strict=True):
        if samples:
            seq.append_token(rng.randrange(100) if rng else 7)
            if seq.num_output_tokens >= seq.sampling_params.max_tokens:
                seq.finish(FinishReason.LENGTH)
    s.finish_step(batch.seqs)
    return batch


def test_budget_and_seq_limits_hold():
    s = _scheduler(num_blocks=64, max_num_seqs=3, budget=10)
    for i in range(5):
        s.add(Sequence(str(i), list(range(1, 8)), SamplingParams(max_tokens=3)))
    batch = s.schedule()
    assert batch.total_tokens <= 10
    assert len(s.running) <= 3
    assert batch.num_new_tokens == [7, 3]  # the second prompt is chunked to fit the budget


def test_long_prompt_is_chunked_and_shares_the_budget_with_decodes():
    s = _scheduler(num_blocks=64, budget=8)
    short = Sequence("short", [1, 2, 3], SamplingParams(max_tokens=10))
    s.add(short)
    _run_step(s)  # short prefilled, now decoding
    long = Sequence("long", list(range(1, 30)), SamplingParams(max_tokens=1))
    s.add(long)
    batch = s.schedule()
    assert batch.seqs == [short, long]
    assert batch.num_new_tokens == [1, 7]  # the decode runs; the long prompt takes the rest


def test_preemption_takes_the_tail_and_requeues_it_at_the_head():
    s = _scheduler(num_blocks=4, block_size=4, budget=64)
    a = Sequence("a", list(range(1, 9)), SamplingParams(max_tokens=8))
    b = Sequence("b", list(range(1, 9)), SamplingParams(max_tokens=8))
    s.block_manager.enable_prefix_caching = False
    s.add(a)
    s.add(b)
    _run_step(s)  # both prefilled: all 4 blocks in use, each has 9 tokens now
    batch = s.schedule()  # a needs a third block: b (the tail) is preempted
    assert batch.num_preempted == 1
    assert b.status is SequenceStatus.WAITING and s.waiting[0] is b
    assert b.num_computed_tokens == 0 and b.block_table == []
    assert batch.seqs == [a]


def test_random_workload_with_aborts_and_preemptions_frees_every_block():
    rng = random.Random(0)
    s = _scheduler(num_blocks=12, block_size=4, max_num_seqs=5, budget=12)
    pool = s.block_manager.pool
    live = []
    for step in range(400):
        if rng.random() < 0.3:
            tokens = [rng.randrange(1, 6) for _ in range(rng.randrange(1, 20))]  # shared prefixes
            seq = Sequence(f"r{step}", tokens, SamplingParams(max_tokens=rng.randrange(1, 12)))
            s.add(seq)
            live.append(seq)
        if live and rng.random() < 0.1:
            victim = rng.choice(live)
            s.abort({victim.request_id})
        _run_step(s, rng)
        held = [b for seq in s.running for b in seq.block_table]
        assert pool.num_free_blocks == pool.num_blocks - len(set(held))
        assert sum(b.ref_count for b in pool.blocks) == len(held)
    while s.has_unfinished():
        _run_step(s, rng)
    assert s.num_preemptions > 0
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_count == 0 for b in pool.blocks)


def test_abort_frees_blocks_wherever_the_sequence_is():
    s = _scheduler(num_blocks=8, budget=4)
    a = Sequence("a", list(range(1, 10)), SamplingParams(max_tokens=4))
    s.add(a)
    s.schedule()  # partially prefilled (chunk of 4), holds a block
    assert a.block_table
    aborted = s.abort({"a"})
    assert aborted == [a] and a.finish_reason is FinishReason.ABORT
    assert s.block_manager.pool.num_free_blocks == 8
    assert not s.has_unfinished()

"""Scheduler invariants: budgets, chunked prefill, preemption from the tail, aborts anywhere, no
block leaked after any workload, and what a step's output does to its sequences (tokens filled
in, stops, finished sequences freed)."""

from __future__ import annotations

import random

from atom_runtime.core.batch import StepOutput
from atom_runtime.core.block_manager import BlockManager
from atom_runtime.core.block_pool import BlockPool
from atom_runtime.core.scheduler import Scheduler
from atom_runtime.core.sequence import FinishReason, Sequence, SequenceStatus
from atom_runtime.sampling_params import SamplingParams

EOS = 99


def _scheduler(num_blocks=16, block_size=4, max_num_seqs=4, budget=16, max_model_len=64):
    pool = BlockPool(num_blocks, block_size)
    return Scheduler(BlockManager(pool), max_num_seqs, budget, max_model_len, [EOS])


def _run_step(s: Scheduler, rng: random.Random | None = None, tokens: list[int] | None = None):
    """Schedule, stand in for the model (the sequences whose chunk reaches their last token
    sample one: from `tokens`, else random or 7), and apply the step's output."""
    batch = s.schedule()
    samplers = [
        seq
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
        if seq.num_computed_tokens + n == seq.num_tokens
    ]
    s.commit(batch, samplers)
    if tokens is None:
        tokens = [rng.randrange(EOS) if rng else 7 for _ in samplers]
    output = StepOutput(samplers, tokens[: len(samplers)]) if samplers else None
    return batch, *s.update_from_output(batch, output)


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
    assert b.num_computed_tokens == 0 and len(b.block_table) == 0
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


def test_a_step_output_fills_tokens_stops_and_frees_finished_sequences():
    s = _scheduler(num_blocks=16, budget=64)
    stop = Sequence("stop", [1, 2, 3], SamplingParams(max_tokens=8, stop_token_ids=[42]))
    eos = Sequence("eos", [4, 5, 6], SamplingParams(max_tokens=8))
    length = Sequence("length", [7, 8], SamplingParams(max_tokens=2, ignore_eos=True))
    for seq in (stop, eos, length):
        s.add(seq)
    batch, outs, finished = _run_step(s, tokens=[5, 6, EOS])
    assert (outs.request_ids, outs.token_ids) == (["stop", "eos", "length"], [5, 6, EOS])
    # Each first token brings the request's once-only facts; none is finished yet.
    assert [o.request_id for o in outs.updates] == ["stop", "eos", "length"]
    assert finished == [] and all(o.finish_reason is None for o in outs.updates)
    first = outs.updates[0]
    assert first.first_scheduled_time is not None and first.first_token_time is not None
    assert first.num_prompt_tokens == 3
    _, outs, finished = _run_step(s, tokens=[42, EOS, 3])
    assert outs.token_ids == [42, EOS, 3]
    assert [(o.request_id, o.finish_reason, o.stop_reason) for o in outs.updates] == [
        ("stop", "stop", 42),  # a stop token id: its id is the stop reason
        ("eos", "stop", None),  # EOS is no user stop token
        ("length", "length", None),  # max_tokens reached (EOS ignored on the way)
    ]
    assert finished == [stop, eos, length]
    assert list(stop.output_token_ids) == [5, 42] and list(length.output_token_ids) == [EOS, 3]
    assert not s.has_unfinished() and s.requests == {}
    assert s.block_manager.pool.num_free_blocks == 16
    assert s.generation_tokens == 6 and s.prompt_tokens == 8


def test_min_tokens_and_the_context_length_decide_stops():
    s = _scheduler(num_blocks=16, budget=64, max_model_len=6)
    early = Sequence("early", [1, 2], SamplingParams(max_tokens=None, min_tokens=2))
    s.add(early)
    _, outs, _ = _run_step(s, tokens=[EOS])
    assert outs.updates[0].finish_reason is None  # EOS before min_tokens does not stop
    _, outs, _ = _run_step(s, tokens=[EOS])
    assert outs.finished()["early"].finish_reason == "stop"
    long = Sequence("long", [1, 2, 3, 4], SamplingParams(max_tokens=None, ignore_eos=True))
    s.add(long)
    _run_step(s, tokens=[10])
    _, outs, finished = _run_step(s, tokens=[11])
    assert (outs.finished()["long"].finish_reason, finished) == ("length", [long])  # 6 tokens
    assert long.num_tokens == 6


def test_a_sequence_finished_while_its_step_was_in_flight_is_skipped():
    """Async scheduling: the step after a stop was already launched when the stop was found;
    its row for the finished sequence is dropped, the other rows apply, and the stopped
    sequence's pending token is gone."""
    s = _scheduler(num_blocks=16, budget=64)
    a = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=8, stop_token_ids=[42]))
    b = Sequence("b", [4, 5, 6], SamplingParams(max_tokens=8))
    s.add(a)
    s.add(b)
    first = s.schedule()
    s.commit(first, [a, b])
    s.update_from_output(first, StepOutput([a, b], [10, 11]))
    second = s.schedule()  # launched: a and b each get a pending token
    s.commit(second, [a, b])
    third = s.schedule()  # launched before the second step's samples are read back
    s.commit(third, [a, b])
    assert a.num_pending == b.num_pending == 2
    outs, finished = s.update_from_output(second, StepOutput([a, b], [42, 12]))
    assert finished == [a] and a.finish_reason is FinishReason.STOP
    assert list(a.output_token_ids) == [10, 42] and a.num_pending == 0
    outs, finished = s.update_from_output(third, StepOutput([a, b], [77, 13]))
    assert outs.request_ids == ["b"] and not outs.updates and finished == []
    assert list(b.output_token_ids) == [11, 12, 13] and b.num_pending == 0

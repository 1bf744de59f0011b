"""The scheduler's speculative steps (core/spec_schedule.py), driven by hand: KV reserved for the
drafts and the drafter's lookahead, drafts placed after the last token and taken back, rejected
drafts' KV no longer counted, only accepted tokens' blocks hashed and announced, stops inside
an accepted run, drafts capped by max_tokens and the context length, every block back at the
end, the acceptance counters."""

from __future__ import annotations

from atom_runtime.core.batch import StepOutput
from atom_runtime.core.block_manager import BlockManager
from atom_runtime.core.block_pool import BlockPool
from atom_runtime.core.scheduler import Scheduler
from atom_runtime.core.sequence import Sequence
from atom_runtime.sampling_params import SamplingParams

BS = 4
K = 3


def _scheduler(lookahead=K, num_blocks=16, max_model_len=40):
    pool = BlockPool(num_blocks, BS, enable_events=True)
    s = Scheduler(BlockManager(pool), 4, 64, max_model_len, [99], num_speculative_tokens=K,
                  spec_lookahead=lookahead)  # fmt: skip
    return s, pool


def _step(s, emitted: dict[Sequence, list[int]]):
    """Schedule, commit, and apply `emitted` (each sampler's accepted drafts + its own token)."""
    batch = s.schedule()
    samplers = [seq for seq in batch.seqs if seq in emitted]
    s.commit(batch, samplers)
    tokens = [t for seq in samplers for t in emitted[seq]]
    output = StepOutput(samplers, tokens, num_tokens=[len(emitted[seq]) for seq in samplers])
    return batch, *s.update_from_output(batch, output)


def _stored(pool):
    return [list(e.token_ids) for e in pool.drain_events() if type(e).__name__ == "BlockStored"]


def test_a_verify_step_reserves_rolls_back_and_publishes_only_accepted_blocks():
    s, pool = _scheduler()
    seq = Sequence("a", [1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=30))
    s.add(seq)
    _step(s, {seq: [9]})  # the prompt and its first token: 5 + 3 lookahead slots reserved
    assert len(seq.block_table) == 2 and _stored(pool) == [[1, 2, 3, 4]]
    seq.spec_token_ids = [10, 11, 12]
    batch = s.schedule()
    assert batch.num_new_tokens == [4]  # the last token and three drafts
    assert seq.token_ids.tolist() == [1, 2, 3, 4, 5, 9, 10, 11, 12] and seq.num_spec == 3
    assert len(seq.block_table) * BS >= 5 + 4 + K  # verified tokens and the lookahead
    s.commit(batch, [seq])
    s.update_from_output(batch, StepOutput([seq], [10, 20], num_tokens=[2]))  # 10 kept, 11 not
    assert seq.token_ids.tolist() == [1, 2, 3, 4, 5, 9, 10, 20]
    assert seq.num_computed_tokens == 7 and seq.num_spec == 0
    assert _stored(pool) == []  # block [5, 9, 10, 11] held a rejected draft: never hashed
    seq.spec_token_ids = [21, 22, 23]
    _step(s, {seq: [21, 22, 23, 24]})  # all accepted, plus the bonus
    assert seq.num_computed_tokens == 11
    assert _stored(pool) == [[5, 9, 10, 20]]
    stats = s.spec_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 6, 4)
    assert stats.accepted_per_pos == [2, 1, 1] and stats.acceptance_lengths == [0, 1, 0, 1]


def test_a_stop_inside_the_accepted_run_ends_there_and_frees_every_block():
    s, pool = _scheduler()
    p = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[31])
    seq = Sequence("a", [1, 2, 3], p)
    s.add(seq)
    _step(s, {seq: [7]})
    seq.spec_token_ids = [30, 31, 32]
    _, outputs, finished = _step(s, {seq: [30, 31, 32, 33]})
    assert finished == [seq] and seq.output_token_ids.tolist() == [7, 30, 31]
    assert outputs.token_ids == [30, 31] and seq.stop_reason == 31
    assert pool.num_free_blocks == pool.num_blocks


def test_drafts_are_capped_by_max_tokens_the_context_and_the_budget():
    s, _ = _scheduler(max_model_len=12)
    seq = Sequence("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    s.add(seq)
    _step(s, {seq: [7]})
    seq.spec_token_ids = [8, 9, 10]
    batch = s.schedule()
    assert seq.num_spec == 2  # 4 tokens at most: one out, two drafts, one of its own
    s.commit(batch, [seq])
    s.update_from_output(batch, StepOutput([seq], [8, 9, 5], num_tokens=[3]))
    assert seq.is_finished and seq.output_token_ids.tolist() == [7, 8, 9, 5]
    long = Sequence("b", list(range(1, 10)), SamplingParams(temperature=0, max_tokens=None))
    s.add(long)
    _step(s, {long: [7]})
    long.spec_token_ids = [8, 9, 10]
    s.schedule()
    assert long.num_spec == 1  # 10 tokens + 1 draft + its own = the context of 12


def test_short_of_blocks_a_step_runs_without_its_drafts_and_preemption_drops_them():
    s, pool = _scheduler(num_blocks=3, lookahead=0)
    a = Sequence("a", list(range(1, 8)), SamplingParams(temperature=0, max_tokens=30))
    s.add(a)
    _step(s, {a: [7]})
    a.spec_token_ids = [8, 9, 10, 11]
    batch = s.schedule()
    assert a.num_spec == 3 and len(a.block_table) == 3  # 8 tokens + 3 drafts: all 3 blocks
    s.commit(batch, [a])
    s.update_from_output(batch, StepOutput([a], [8, 1], num_tokens=[2]))
    a.spec_token_ids = [5, 6, 7]  # 10 tokens + 3 drafts would need a 4th block
    batch = s.schedule()
    assert batch.num_new_tokens == [1] and a.num_spec == 0 and pool.num_free_blocks == 0
    s.commit(batch, [a])
    s.update_from_output(batch, StepOutput([a], [2], num_tokens=[1]))
    assert a.output_token_ids.tolist() == [7, 8, 1, 2] and a.num_computed_tokens == 10
    s.running.remove(a)
    s._preempt(a)
    assert a.spec_token_ids == [] and pool.num_free_blocks == pool.num_blocks

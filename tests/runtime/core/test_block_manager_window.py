"""KV groups in the block manager (docs/models.md): a model's sliding-window layers hold blocks
of their own beside the full-attention table, give each back once the next query's window has
passed it, publish their hashes in a prefix index of their own (no KV events), and a prefix hit
is the longest prefix both groups serve. No model: the pool and the manager alone."""

from __future__ import annotations

from array import array

from atom_runtime.core.block_manager import BlockManager
from atom_runtime.core.block_pool import BlockPool
from atom_runtime.core.sequence import Sequence
from atom_runtime.kv_events import BlockRemoved, BlockStored
from atom_runtime.sampling_params import SamplingParams

BS, WINDOW = 4, 6  # a query sees itself and the 5 positions before it


def _seq(tokens, name="s") -> Sequence:
    return Sequence(name, list(tokens), SamplingParams(max_tokens=64))


def _run(bm: BlockManager, seq: Sequence, n: int) -> None:
    """Schedule n tokens of seq, as the scheduler would, and mark them computed."""
    assert bm.allocate(seq, n)
    seq.num_computed_tokens += n
    bm.publish_computed_blocks(seq)


def _held(seq: Sequence) -> list[int]:
    return [i for i, b in enumerate(seq.window_table) if b >= 0]


def test_window_blocks_go_back_as_the_window_passes_them():
    pool = BlockPool(64, BS)
    bm = BlockManager(pool, sliding_window=WINDOW)
    seq = _seq(range(100, 140))
    _run(bm, seq, 10)  # a prompt chunk: blocks 0-2 of both groups
    assert len(seq.block_table) == len(seq.window_table) == 3 and _held(seq) == [0, 1, 2]
    for _ in range(20):  # decode steps: the next query at position p reads p - 5 .. p
        p = seq.num_computed_tokens
        _run(bm, seq, 1)
        assert _held(seq)[0] == max(0, p - WINDOW + 1) // BS
        assert len(_held(seq)) <= WINDOW // BS + 2
    assert len(seq.block_table) == 8 and len(seq.window_table) == 8
    assert set(seq.block_table).isdisjoint(seq.window_table)
    used = len(seq.block_table) + len(_held(seq))
    assert pool.num_free_blocks == 64 - used
    bm.free(seq)
    assert pool.num_free_blocks == 64 and seq.window_table == array("i")


def test_allocation_counts_both_groups_all_or_nothing():
    pool = BlockPool(6, BS)
    bm = BlockManager(pool, sliding_window=WINDOW)
    seq = _seq(range(16))
    assert not bm.allocate(seq, 13)  # 4 blocks of each group: 8 > 6, and no trace left
    assert seq.block_table == array("i") == seq.window_table and pool.num_free_blocks == 6
    _run(bm, seq, 8)  # 2 + 2
    other = _seq(range(50, 54), "o")
    assert bm.allocate(other, 4)  # 1 + 1: the pool is full
    assert not bm.allocate(seq, 1)  # position 8 reads 3..8: block 0 stays, 2 blocks short
    bm.free(other)
    _run(bm, seq, 1)
    assert _held(seq) == [0, 1, 2] and pool.num_free_blocks == 0
    _run(bm, seq, 1)  # position 9 reads 4..9: block 0 goes back
    assert _held(seq) == [1, 2] and pool.num_free_blocks == 1


def test_prefix_hit_needs_the_window_blocks_the_next_query_reads():
    pool = BlockPool(64, BS, enable_events=True)
    bm = BlockManager(pool, sliding_window=WINDOW)
    prompt = list(range(200, 221))  # 21 tokens: 5 full blocks can hit
    first = _seq(prompt, "a")
    _run(bm, first, 21)
    bm.free(first)
    events = pool.drain_events()
    stored = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
    assert stored == first.block_hashes[:5]  # group 0's only
    again = _seq(prompt, "b")
    hit = bm.find_prefix_hit(again)
    assert len(hit) == 5  # the next query (position 20) reads blocks 3 and 4 of the window
    assert bm.allocate(again, 1, hit)
    assert again.num_computed_tokens == 20
    assert list(again.window_table[:3]) == [-1, -1, -1] and _held(again) == [3, 4, 5]
    bm.free(again)


def test_a_hit_shrinks_to_where_the_window_blocks_survive():
    pool = BlockPool(64, BS, enable_events=True)
    bm = BlockManager(pool, sliding_window=WINDOW)
    prompt = list(range(300, 321))
    first = _seq(prompt, "a")
    _run(bm, first, 21)  # blocks 0-4 computed and hashed in both groups
    bm.free(first)
    # Evict group 1's copy of block 4 (the last full block): its hash leaves the window index.
    last = first.block_hashes[4]
    block = pool.cached_window.pop(last)
    pool.blocks[block].clear_hash()
    pool.drain_events()
    hit = bm.find_prefix_hit(_seq(prompt, "b"))
    # 5 blocks need window blocks 3-4 (4 is gone); 4 blocks need 2-3, which survive.
    assert len(hit) == 4
    assert not [e for e in pool.drain_events() if isinstance(e, BlockRemoved)]


def test_freed_before_hashed_window_blocks_are_not_published():
    pool = BlockPool(64, BS)
    bm = BlockManager(pool, sliding_window=WINDOW)
    seq = _seq(range(400, 430))
    assert bm.allocate(seq, 24)
    seq.num_computed_tokens = 24
    # The next step is scheduled (the window gives back blocks 0-3) before this one's blocks
    # are published, as under async scheduling.
    assert bm.allocate(seq, 1)
    bm.publish_computed_blocks(seq)
    window_hashed = {pool.blocks[b].hash for b in seq.window_table if b >= 0} - {None}
    assert window_hashed == set(seq.block_hashes[4:6])
    assert len(pool.cached_window) == 2 and len(pool.cached) == 6
    bm.free(seq)

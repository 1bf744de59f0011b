"""Block pool and block manager invariants: hashing (contract 1, docs/architecture.md), prefix hits (2), eviction (3),
type boundaries (5), lending to non-sequence owners."""

from __future__ import annotations

from array import array

import pytest

from atom_runtime.core.block_manager import BlockManager
from atom_runtime.core.block_pool import Block, BlockPool, NoFreeBlocksError
from atom_runtime.core.sequence import Sequence
from atom_runtime.kv_events import BlockRemoved, BlockStored
from atom_runtime.protocol.block_hash import hash_block_tokens, hash_token_blocks, salt_root
from atom_runtime.sampling_params import SamplingParams


def test_hash_test_vector():
    first = hash_block_tokens(None, [1, 2, 3, 4])
    assert first == 8356527653647720045
    assert hash_block_tokens(first, [5, 6, 7, 8]) == 610383040053763902


def test_list_and_array_tokens_hash_the_same():
    tokens = list(range(100, 132))
    assert hash_token_blocks(tokens, 16) == hash_token_blocks(array("i", tokens), 16)
    assert hash_block_tokens(7, tokens[:16]) == hash_block_tokens(7, array("i", tokens[:16]))


def test_block_refuses_a_list_where_an_array_belongs():
    block = Block(0)
    with pytest.raises(TypeError, match="array"):
        block.set_hash(1, [1, 2, 3])
    block.set_hash(1, array("i", [1, 2, 3]))  # positive control
    assert block.hash == 1


def _seq(rid: str, tokens) -> Sequence:
    return Sequence(rid, tokens, SamplingParams(max_tokens=4))


def _compute(manager: BlockManager, seq: Sequence) -> None:
    """Pretend the forward pass computed everything allocated so far."""
    seq.num_computed_tokens = seq.num_tokens
    manager.publish_computed_blocks(seq)


def test_eviction_prefers_never_hashed_then_least_recently_freed():
    pool = BlockPool(4, 4)
    manager = BlockManager(pool)
    a, b = _seq("a", range(1, 9)), _seq("b", range(11, 19))  # two full blocks each
    assert manager.allocate(a, 8) and manager.allocate(b, 8)
    _compute(manager, a)
    _compute(manager, b)
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    manager.free(a)  # freed tail first: a's block 1, then a's block 0
    manager.free(b)
    assert pool.num_free_blocks == 4
    # Nothing is never-hashed now: eviction follows the order of freeing.
    order = [pool.allocate(1)[0] for _ in range(4)]
    assert order == [a_blocks[1], a_blocks[0], b_blocks[1], b_blocks[0]]
    assert all(pool.blocks[i].hash is None for i in order)
    assert not pool.cached


def test_plain_free_blocks_go_before_cached_ones():
    pool = BlockPool(3, 4)
    manager = BlockManager(pool)
    a = _seq("a", range(1, 5))
    assert manager.allocate(a, 4)
    _compute(manager, a)
    cached_block = a.block_table[0]
    manager.free(a)
    got = pool.allocate(2)
    assert cached_block not in got
    assert pool.cached  # still cached
    assert pool.allocate(1) == [cached_block]
    assert not pool.cached


def test_double_free_raises():
    pool = BlockPool(2, 4)
    ids = pool.allocate(1)
    pool.free(ids)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(ids)


def test_allocation_is_all_or_nothing():
    pool = BlockPool(3, 4)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(4)
    assert pool.num_free_blocks == 3


def test_lend_and_take_back_are_atomic():
    pool = BlockPool(4, 4)
    lent = pool.lend(3, owner="checkpoint")
    assert pool.num_free_blocks == 1 and set(pool.lent) == set(lent)
    with pytest.raises(NoFreeBlocksError):
        pool.lend(2, owner="checkpoint")
    assert pool.num_free_blocks == 1
    plain = pool.allocate(1)[0]
    with pytest.raises(RuntimeError, match="not lent"):
        pool.take_back([lent[0], plain])
    assert set(pool.lent) == set(lent)  # nothing taken back
    pool.take_back(lent)
    assert not pool.lent and pool.num_free_blocks == 3
    pool.free([plain])
    assert pool.num_free_blocks == 4


def test_last_block_is_always_recomputed():
    pool = BlockPool(8, 4)
    manager = BlockManager(pool)
    a = _seq("a", range(1, 9))  # exactly two full blocks
    assert manager.allocate(a, 8)
    _compute(manager, a)
    manager.free(a)
    b = _seq("b", range(1, 9))
    hit = manager.find_prefix_hit(b)
    assert len(hit) == 1  # the block holding the last token is never served from cache
    c = _seq("c", range(1, 10))  # one more token: both full blocks can hit
    assert len(manager.find_prefix_hit(c)) == 2


def test_hit_requires_matching_tokens_not_just_hash():
    pool = BlockPool(4, 4)
    manager = BlockManager(pool)
    a = _seq("a", range(1, 6))
    assert manager.allocate(a, 5)
    _compute(manager, a)
    # Corrupt the cached block's tokens: same hash, different tokens must not hit.
    block = pool.blocks[a.block_table[0]]
    block.token_ids = array("i", [9, 9, 9, 9])
    assert manager.find_prefix_hit(_seq("b", range(1, 6))) == []


def test_chain_hashing_in_one_pass_matches_block_by_block():
    """hash_token_blocks (one int64 conversion, a C call per block) gives contract 1's digests,
    chained from a parent, for list and array input, ignoring a trailing partial block."""
    tokens = list(range(7, 7 + 16 * 5 + 3))
    parent = hash_block_tokens(None, [1, 2, 3, 4])
    expected, prev = [], parent
    for i in range(5):
        prev = hash_block_tokens(prev, tokens[i * 16 : (i + 1) * 16])
        expected.append(prev)
    assert hash_token_blocks(tokens, 16, parent) == expected
    assert hash_token_blocks(array("i", tokens), 16, parent) == expected
    assert hash_token_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4) == [
        8356527653647720045,
        610383040053763902,
    ]


def test_a_token_mismatch_mid_chain_ends_the_hit_there():
    """Contract 2 over a long prefix: the hit is the leading run whose hashes AND tokens match;
    a corrupted block in the middle cuts it, even though later hashes are still indexed."""
    pool = BlockPool(64, 4)
    manager = BlockManager(pool)
    a = _seq("a", range(1, 42))  # ten full blocks and one token
    assert manager.allocate(a, 41)
    _compute(manager, a)
    table = list(a.block_table)
    manager.free(a)
    assert manager.find_prefix_hit(_seq("b", range(1, 42))) == table[:10]
    pool.blocks[table[6]].token_ids = array("i", [0, 0, 0, 0])
    assert manager.find_prefix_hit(_seq("c", range(1, 42))) == table[:6]


def test_hashes_are_computed_once_per_sequence_and_extended_incrementally():
    pool = BlockPool(64, 4)
    manager = BlockManager(pool)
    seq = _seq("a", range(1, 42))
    manager.find_prefix_hit(seq)
    first = list(seq.block_hashes)
    assert first == hash_token_blocks(list(range(1, 41)), 4)
    for t in range(42, 50):  # generated tokens extend the chain without rehashing the prompt
        seq.append_pending(1 << 30)
        seq.resolve_pending(t)
    assert manager.allocate(seq, seq.num_tokens)
    _compute(manager, seq)
    assert seq.block_hashes[:10] == first
    assert seq.block_hashes == hash_token_blocks(list(range(1, 50)), 4)


def test_hits_on_idle_blocks_count_against_free_blocks_and_leave_the_free_list():
    pool = BlockPool(6, 4)
    manager = BlockManager(pool)
    a = _seq("a", range(1, 14))  # three full blocks and one token: four blocks
    assert manager.allocate(a, 13)
    _compute(manager, a)
    table = list(a.block_table)
    manager.free(a)
    b = _seq("b", range(1, 14))
    hit = manager.find_prefix_hit(b)
    assert hit == table[:3] and pool.num_idle(hit) == 3
    # b needs its three hit blocks (idle, so taken from the free list) plus one new block.
    assert manager.allocate(b, 1, hit)
    assert [pool.blocks[x].ref_count for x in hit] == [1, 1, 1]
    assert pool.num_free_blocks == 2 and pool.num_idle(hit) == 0
    c = _seq("c", range(1, 14))
    assert manager.allocate(c, 1, manager.find_prefix_hit(c))  # shared: no new idle hits
    assert [pool.blocks[x].ref_count for x in hit] == [2, 2, 2]
    assert pool.num_free_blocks == 1


def test_chain_gap_skips_hashing():
    pool = BlockPool(4, 4)
    manager = BlockManager(pool)
    a = _seq("a", range(1, 13))
    assert manager.allocate(a, 12)
    a.num_computed_tokens = 4
    manager.publish_computed_blocks(a)
    assert a.num_hashed_blocks == 1
    pool.blocks[a.block_table[0]].clear_hash()  # the parent lost its hash
    a.num_computed_tokens = 12
    manager.publish_computed_blocks(a)
    assert a.num_hashed_blocks == 1
    assert pool.blocks[a.block_table[1]].hash is None


def test_events_one_stored_per_run_and_removed_on_eviction():
    pool = BlockPool(3, 4, enable_events=True)
    manager = BlockManager(pool)
    a = _seq("a", range(1, 10))
    assert manager.allocate(a, 9)
    _compute(manager, a)
    events = pool.drain_events()
    hashes = hash_token_blocks(list(range(1, 10)), 4)
    assert events == [
        BlockStored(
            block_hashes=hashes, parent_block_hash=None, token_ids=list(range(1, 9)), block_size=4
        )
    ]
    manager.free(a)
    # A hit emits nothing.
    b = _seq("b", range(1, 10))
    hit = manager.find_prefix_hit(b)
    assert manager.allocate(b, 9 - 8, hit)
    assert pool.drain_events() == []
    manager.free(b)
    pool.allocate(3)  # evicts both cached blocks
    removed = pool.drain_events()
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(hashes)
    assert all(isinstance(e, BlockRemoved) for e in removed)


def test_lending_evicts_cached_blocks_with_the_usual_events_and_lent_blocks_stay_unhashed():
    """State checkpoints borrow blocks through `lend`: plain free blocks first, then cached ones
    freed longest ago first (a sequence frees its tail first), each eviction a BlockRemoved as
    for any allocation; the lent blocks carry no hash, and taking them back stores nothing."""
    pool = BlockPool(4, 4, enable_events=True)
    manager = BlockManager(pool)
    a = _seq("a", range(1, 10))  # two full blocks and one partial
    assert manager.allocate(a, 9)
    _compute(manager, a)
    first, second = hash_token_blocks(list(range(1, 10)), 4)
    manager.free(a)
    pool.drain_events()
    lent = pool.lend(3, owner="state-ckpt:0.0")  # two plain blocks, then the tail block
    assert pool.drain_events() == [BlockRemoved(block_hashes=[second])]
    assert set(pool.cached) == {first}
    assert all(pool.blocks[b].hash is None for b in lent)
    pool.take_back(lent)
    assert pool.drain_events() == [] and set(pool.cached) == {first}


def test_decode_blocks_are_hashed_so_follow_ups_reuse_generated_text():
    pool = BlockPool(8, 4)
    manager = BlockManager(pool)
    a = _seq("a", range(1, 4))  # 3 prompt tokens
    assert manager.allocate(a, 3)
    a.num_computed_tokens = 3
    for token in (50, 51, 52, 53, 54):  # generated text
        a.token_ids.append(token)
        assert manager.allocate(a, 1)
        a.num_computed_tokens += 1
        manager.publish_computed_blocks(a)
    assert a.num_hashed_blocks == 2
    manager.free(a)
    follow_up = _seq("b", [1, 2, 3, 50, 51, 52, 53, 54, 60])
    assert len(manager.find_prefix_hit(follow_up)) == 2


def test_reset_prefix_cache_refused_while_blocks_in_use():
    pool = BlockPool(2, 4, enable_events=True)
    ids = pool.allocate(1)
    assert pool.reset_prefix_cache() is False
    pool.free(ids)
    assert pool.reset_prefix_cache() is True
    assert pool.drain_events()[-1].__class__.__name__ == "AllBlocksCleared"


def test_hashes_reused_from_the_last_prompt_equal_hashing_from_scratch():
    """A prompt sharing leading tokens with the last one hashed takes those digests over; every
    chain equals contract 1's hashes of its own tokens, wherever the prompts diverge."""
    manager = BlockManager(BlockPool(64, 4))
    base = list(range(100, 141))  # ten full blocks and one token
    cases = [
        base,  # identical
        base[:22] + [7] + base[23:],  # diverges inside block 5
        [9] + base[1:],  # diverges in the first block
        base[:13],  # shorter: three blocks
        base + list(range(500, 520)),  # longer than the last one hashed
        base[:24] + list(range(900, 917)),  # diverges exactly at a block boundary
    ]
    for i, tokens in enumerate(cases):
        seq = _seq(f"s{i}", tokens)
        manager.find_prefix_hit(seq)
        assert seq.block_hashes == hash_token_blocks(tokens[: len(tokens) - 1], 4), i


def test_a_cache_salt_starts_its_own_chain_and_unsalted_hashes_stay_contract_1():
    """A salted prompt's blocks hash from its salt's root, so no block of it equals the same
    tokens unsalted or under another salt (vLLM's cache_salt), and a salted prompt never finds an
    unsalted one's blocks, even through the last-prompt shortcut; unsalted stays contract 1."""
    manager = BlockManager(BlockPool(64, 4))
    tokens = list(range(100, 117))  # four full blocks and one token
    chains = {}
    for salt in (None, "alice", "bob", None):
        seq = _seq(f"s-{salt}", tokens)
        seq.hash_root = salt_root(salt)
        hit = manager.find_prefix_hit(seq)
        assert len(hit) == (4 if salt is None and None in chains else 0)  # only its own chain
        assert manager.allocate(seq, len(tokens) - 4 * len(hit), hit)
        seq.num_computed_tokens = len(tokens)
        manager.publish_computed_blocks(seq)
        chains[salt] = list(seq.block_hashes)
        manager.free(seq)
    assert chains[None] == hash_token_blocks(tokens[:16], 4)  # contract 1, unchanged
    assert chains["alice"] == hash_token_blocks(tokens[:16], 4, parent=salt_root("alice"))
    assert not set(chains["alice"]) & set(chains[None])
    assert not set(chains["alice"]) & set(chains["bob"])
    # Alice's blocks serve only Alice: a guess without her salt finds nothing of hers.
    guess = _seq("guess", tokens)
    guess.hash_root = salt_root("carol")
    assert manager.find_prefix_hit(guess) == []
    again = _seq("alice-again", tokens)
    again.hash_root = salt_root("alice")
    assert len(manager.find_prefix_hit(again)) == 4

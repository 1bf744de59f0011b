"""The state checkpoint store on a real BlockPool: record lifetime COPYING -> READY -> EVICTING,
two-phase publication, pins, generations, LRU, the watermark, reclaim for live KV (contract 6)."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.registry import Collector

from atom_runtime.core.block_manager import BlockManager
from atom_runtime.core.block_pool import BlockPool
from atom_runtime.core.sequence import Sequence
from atom_runtime.protocol.checkpoint_counters import StateCheckpointCounters
from atom_runtime.sampling_params import SamplingParams
from atom_runtime.state.checkpoint_record import CheckpointRef, CheckpointState
from atom_runtime.state.checkpoint_spec import PagedStateCheckpointSpec
from atom_runtime.state.checkpoint_store import StateCheckpointStore

BS = 4
# 250 image bytes in 100-byte units: 3 units per checkpoint.
SPEC = PagedStateCheckpointSpec(page_unit_bytes=100, slot_bytes=250, image_bytes=250, layout_id="t")


def _store(num_blocks=40, max_units=12, min_free_blocks=0) -> StateCheckpointStore:
    pool = BlockPool(num_blocks, BS)
    return StateCheckpointStore(pool, SPEC, max_units=max_units, min_free_blocks=min_free_blocks)


def _ready(store, prefix_hash, num_tokens=BS, batch=0, demand=False):
    staged = store.stage(prefix_hash, num_tokens, demand=demand)
    store.launch(staged.ref, batch)
    assert store.publish(batch) == [staged.ref]
    return staged


def test_stage_borrows_units_from_the_pool_in_the_records_name():
    store = _store()
    staged = store.stage(101, 2 * BS)
    assert len(staged.units) == 3
    for u in staged.units:
        assert store.pool.lent[u] == f"state-ckpt:{staged.ref.index}.{staged.ref.generation}"
    assert store.pool.num_free_blocks == 37
    assert store.units_in_use == store.counters.units_in_use == 3
    store.check_invariants()


def test_a_copying_record_is_invisible_until_the_batch_carrying_its_copy_has_run():
    store = _store()
    hashes = [100, 101]
    staged = store.stage(101, 2 * BS)
    assert store.lookup(hashes, 2) is None  # staged only
    store.launch(staged.ref, batch_id=7)
    assert store.lookup(hashes, 2) is None  # queued on a launch that has not run
    assert store.publish(6) == []  # another batch finishing publishes nothing of ours
    assert store.state_of(staged.ref) is CheckpointState.COPYING
    assert store.publish(7) == [staged.ref]
    hit = store.lookup(hashes, 2)
    assert (hit.ref, hit.num_tokens, hit.units) == (staged.ref, 2 * BS, staged.units)
    assert store.counters.stored == 1
    store.check_invariants()


def test_a_prefix_hash_maps_to_at_most_one_record():
    store = _store()
    first = store.stage(55, BS)
    assert store.stage(55, BS) is None  # a copy of that prefix is under way
    store.launch(first.ref, 0)
    store.publish(0)
    assert store.stage(55, BS) is None  # and now it is READY
    assert store.units_in_use == 3
    assert store.counters.dropped == 0  # already kept is not dropped
    store.check_invariants()


def test_lookup_returns_the_deepest_ready_checkpoint_at_or_below_the_kv_hit():
    store = _store()
    hashes = [10, 11, 12, 13, 14]
    _ready(store, 11, 2 * BS)
    _ready(store, 13, 4 * BS)
    assert store.lookup(hashes, 5).num_tokens == 4 * BS
    assert store.lookup(hashes, 4).num_tokens == 4 * BS
    assert store.lookup(hashes, 3).num_tokens == 2 * BS
    assert store.lookup(hashes, 1) is None
    # A record whose depth disagrees with the hash's position is not a hit.
    assert store.lookup([13], 1) is None


def test_stage_refuses_a_boundary_off_the_block_grid():
    store = _store()
    with pytest.raises(ValueError, match="^num_tokens: a checkpoint sits on a block boundary"):
        store.stage(1, BS + 1)
    with pytest.raises(ValueError, match="^prefix_hash"):
        store.stage(-1, BS)


def test_lru_evicts_the_least_recently_used_whole_record_and_acquire_refreshes():
    store = _store(max_units=9)  # room for three records
    a, b, c = (_ready(store, h, batch=h) for h in (1, 2, 3))
    store.acquire(a.ref)
    store.release(a.ref)  # a is now the most recently used
    d = store.stage(4, BS)
    assert d is not None
    assert store.state_of(b.ref) is None  # b was least recently used: evicted, all 3 units
    assert store.state_of(a.ref) is CheckpointState.READY
    assert store.state_of(c.ref) is CheckpointState.READY
    assert store.counters.evicted == 1
    assert store.units_in_use == 9
    store.check_invariants()


def test_demand_checkpoints_enter_at_the_lru_head():
    store = _store(max_units=9)
    a = _ready(store, 1, batch=1)
    demand = _ready(store, 2, batch=2, demand=True)
    _ready(store, 3, batch=3)
    assert store.stage(4, BS) is not None
    assert store.state_of(demand.ref) is None  # newest, but speculative: evicted first
    assert store.state_of(a.ref) is CheckpointState.READY


def test_a_demand_checkpoint_that_served_a_reader_is_kept_like_any_other():
    store = _store(max_units=9)
    a = _ready(store, 1, batch=1)
    demand = _ready(store, 2, batch=2, demand=True)
    store.acquire(demand.ref)
    store.release(demand.ref)
    _ready(store, 3, batch=3)
    assert store.stage(4, BS) is not None
    assert store.state_of(a.ref) is None
    assert store.state_of(demand.ref) is CheckpointState.READY


def test_pinned_records_are_never_evicted_and_a_full_store_drops_the_new_checkpoint():
    store = _store(max_units=6)
    a, b = _ready(store, 1, batch=1), _ready(store, 2, batch=2)
    store.acquire(a.ref)
    store.acquire(b.ref)
    assert store.stage(3, BS) is None
    assert store.counters.dropped == 1
    assert store.reclaim(100) == 0
    assert store.units_in_use == 6
    store.release(b.ref)
    assert store.stage(3, BS) is not None  # b is evictable again
    assert store.state_of(b.ref) is None
    assert store.state_of(a.ref) is CheckpointState.READY
    store.check_invariants()


def test_watermark_keeps_free_blocks_for_live_kv():
    store = _store(num_blocks=20, max_units=12, min_free_blocks=10)
    assert store.stage(1, BS) is not None  # 17 free left
    assert store.stage(2, BS) is not None  # 14
    assert store.stage(3, BS) is not None  # 11
    assert store.stage(4, BS) is None  # would leave 8 < 10; COPYING records cannot be evicted
    assert store.counters.dropped == 1
    assert store.pool.num_free_blocks == 11
    store.check_invariants()


def test_watermark_evicts_old_checkpoints_only_when_that_makes_room():
    store = _store(num_blocks=20, max_units=12, min_free_blocks=10)
    old = _ready(store, 1, batch=1)
    live_kv = store.pool.allocate(6)  # live sequences grow: 20 - 3 - 6 = 11 free
    new = store.stage(2, BS)  # 11 - 3 = 8 < 10: evict old (frees 3) -> 14 - 3 = 11 >= 10
    assert new is not None and store.state_of(old.ref) is None
    more_kv = store.pool.allocate(4)  # 7 free
    assert store.stage(3, BS) is None  # only a COPYING record remains: nothing evictable
    assert store.state_of(new.ref) is CheckpointState.COPYING
    store.pool.free(live_kv + more_kv)
    store.check_invariants()


def test_reclaim_frees_checkpoints_so_a_sequence_can_allocate():
    pool = BlockPool(10, BS)
    store = StateCheckpointStore(pool, SPEC, max_units=9, min_free_blocks=0)
    a, b = _ready(store, 1, batch=1), _ready(store, 2, batch=2)
    queued = store.stage(3, BS)  # COPYING, not launched: cancellable
    manager = BlockManager(pool)
    seq = Sequence("s", list(range(1, 5 * BS + 1)), SamplingParams(max_tokens=1))
    assert pool.num_free_blocks == 1
    assert not manager.allocate(seq, 5 * BS)
    returned = store.reclaim(5 - pool.num_free_blocks)
    assert returned == 6  # whole records: a then b (LRU order), enough before the queued copy
    assert store.state_of(a.ref) is None and store.state_of(b.ref) is None
    assert store.state_of(queued.ref) is CheckpointState.COPYING
    assert manager.allocate(seq, 5 * BS)
    assert store.reclaim(10) == 3  # the queued copy goes last
    assert store.state_of(queued.ref) is None
    store.check_invariants()


def test_reclaim_cancels_queued_copies_but_not_launched_ones():
    store = _store(num_blocks=10, max_units=9)
    queued = store.stage(1, BS)
    launched = store.stage(2, BS)
    store.launch(launched.ref, 5)
    assert store.reclaim(6) == 3
    assert store.state_of(queued.ref) is None
    assert store.state_of(launched.ref) is CheckpointState.COPYING
    assert store.counters.dropped == 1
    store.check_invariants()


def test_cancelling_a_queued_copy_returns_its_units_at_once():
    store = _store()
    staged = store.stage(9, BS)
    assert store.cancel(staged.ref) is True
    assert store.units_in_use == 0 and not store.pool.lent
    assert store.cancel(staged.ref) is False  # already gone
    assert store.stage(9, BS) is not None  # the hash is free again
    store.check_invariants()


def test_a_record_unindexed_during_its_copy_is_cleaned_up_after_the_batch_never_leaked():
    store = _store()
    staged = store.stage(9, BS)
    store.launch(staged.ref, 3)
    assert store.cancel(staged.ref) is True
    assert store.state_of(staged.ref) is CheckpointState.EVICTING
    assert store.lookup([9], 1) is None
    assert store.units_in_use == 3  # the launch still writes into them
    store.check_invariants()
    assert store.stage(9, BS) is not None  # the hash is free for a fresh copy
    assert store.publish(3) == []
    assert store.state_of(staged.ref) is None
    assert store.counters.orphaned == 1
    assert store.units_in_use == 3  # only the fresh copy
    store.check_invariants()


def test_supersede_frees_a_rolling_anchor_now_or_after_its_readers_and_cancels_a_copy():
    store = _store()
    free = store.pool.num_free_blocks
    idle = _ready(store, 11)
    store.supersede(idle.ref)  # READY, unpinned: gone at once, counted as evicted
    assert store.state_of(idle.ref) is None and store.lookup([11], 1) is None
    assert store.pool.num_free_blocks == free and store.counters.evicted == 1
    read = _ready(store, 12, batch=1)
    store.acquire(read.ref)
    store.supersede(read.ref)  # a reader restores from it: invisible now, freed on unpin
    assert store.state_of(read.ref) is CheckpointState.EVICTING
    assert store.lookup([12], 1) is None
    store.release(read.ref)
    assert store.state_of(read.ref) is None and store.pool.num_free_blocks == free
    queued = store.stage(13, BS)
    store.supersede(queued.ref)  # COPYING: cancelled, its units back
    assert store.state_of(queued.ref) is None and store.counters.dropped == 1
    store.supersede(queued.ref)  # a stale reference: nothing happens
    assert store.pool.num_free_blocks == free and store.units_in_use == 0
    store.check_invariants()


def test_a_rolling_checkpoint_displaces_only_unread_rolling_ones():
    store = _store(max_units=6)  # room for two images
    anchor = _ready(store, 21)
    first = store.stage(22, BS, rolling=True)
    store.launch(first.ref, 1)
    store.publish(1)
    assert store.stage(23, BS, rolling=True) is not None  # evicts the unread rolling one
    assert store.state_of(first.ref) is None and store.state_of(anchor.ref) is not None
    # Full with the anchor and the COPYING 23: neither can go for a rolling checkpoint...
    assert store.stage(24, BS, rolling=True) is None and store.counters.dropped == 1
    store.check_invariants()
    full = _store(max_units=6)
    kept = [_ready(full, h, batch=h) for h in (31, 32)]
    assert full.stage(33, BS, rolling=True) is None  # ...and never an anchor or a rung
    assert full.counters.dropped == 1 and all(full.state_of(k.ref) for k in kept)
    read = full.stage(34, BS, demand=True)  # an ordinary stage may still evict LRU first
    assert read is not None and full.state_of(kept[0].ref) is None
    full.check_invariants()


def test_invalidate_all_waits_for_readers_and_in_flight_copies():
    store = _store()
    pinned = _ready(store, 1, batch=1)
    idle = _ready(store, 2, batch=2)
    store.acquire(pinned.ref)
    in_flight = store.stage(3, BS)
    store.launch(in_flight.ref, 9)
    queued = store.stage(4, BS)
    assert store.invalidate_all() is False
    assert store.state_of(idle.ref) is None and store.state_of(queued.ref) is None
    assert store.state_of(pinned.ref) is CheckpointState.EVICTING
    assert store.state_of(in_flight.ref) is CheckpointState.EVICTING
    assert store.lookup([1, 2, 3, 4], 1) is None
    store.check_invariants()
    store.release(pinned.ref)
    store.publish(9)
    assert store.units_in_use == 0 and not store.pool.lent
    assert store.pool.num_free_blocks == store.pool.num_blocks
    store.check_invariants()


def test_a_vanished_checkpoint_raises_a_clear_runtime_error():
    store = _store(max_units=3)
    old = _ready(store, 1, batch=1)
    new = _ready(store, 2, batch=2)  # evicts old; the record slot is reused
    assert new.ref.index == old.ref.index and new.ref.generation == old.ref.generation + 1
    with pytest.raises(RuntimeError, match="vanished"):
        store.acquire(old.ref)
    with pytest.raises(RuntimeError, match="vanished"):
        store.release(old.ref)
    with pytest.raises(RuntimeError, match="vanished"):
        store.launch(old.ref, 3)
    # The stale reference touched nothing of the record now living in that slot.
    assert store.state_of(new.ref) is CheckpointState.READY
    with pytest.raises(RuntimeError, match="more often than taken"):
        store.release(new.ref)


def test_units_are_taken_back_only_from_their_owner():
    store = _store()
    staged = store.stage(1, BS)
    # Someone else gets hold of one of the record's blocks behind the store's back.
    stolen = staged.units[0]
    store.pool.take_back([stolen])
    store.pool.lent[stolen] = "someone-else"
    with pytest.raises(RuntimeError, match=rf"blocks \[{stolen}\] are not lent to it"):
        store.cancel(staged.ref)


def test_a_store_that_can_never_hold_an_image_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="atom_runtime.state.checkpoint_store"):
        store = _store(num_blocks=20, max_units=2)
    assert not store.can_ever_store
    assert "can never be stored" in caplog.text
    assert store.stage(1, BS) is None
    assert store.counters.dropped == 1


def test_counters_render_as_atom_prometheus_families():
    counters = StateCheckpointCounters(stored=3, chunks_cut_anchor=2, units_in_use=5, pool_units=50)

    class Source(Collector):
        def collect(self):
            return counters.prometheus_families()

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Source())
    text = generate_latest(registry).decode()
    assert "atom:state_checkpoints_stored_total 3.0" in text
    assert 'atom:state_checkpoint_chunks_cut_total{reason="anchor"} 2.0' in text
    assert 'atom:state_checkpoint_chunks_cut_total{reason="rung"} 0.0' in text
    assert 'atom:state_checkpoint_demands_total{outcome="declined"} 0.0' in text
    assert "atom:state_checkpoint_units 5.0" in text
    assert "atom:state_checkpoint_units_ratio 0.1" in text


def test_refs_are_type_checked():
    store = _store()
    with pytest.raises(TypeError, match="CheckpointRef"):
        store.acquire((0, 0))
    assert store.state_of(CheckpointRef(99, 0)) is None

"""Per-batch state maintenance: the affine unit table and its torch reference executor, and the
queue's lifetime invariants (contract 6), each its own test."""

from __future__ import annotations

import pytest
import torch

from atom_runtime.core.block_pool import BlockPool
from atom_runtime.state.checkpoint_record import CheckpointState
from atom_runtime.state.checkpoint_spec import (
    PagedStateCheckpointSpec,
    StatePoolPlan,
    gated_deltanet_state_tensors,
)
from atom_runtime.state.checkpoint_store import StateCheckpointStore
from atom_runtime.state.maintenance import (
    RelocateOp,
    RestoreOp,
    StateMaintenance,
    StateMaintenanceOps,
    StoreOp,
    copy_units_reference,
    plan_unit_table,
    uint8_rows,
)

BS = 4
SPEC = PagedStateCheckpointSpec(page_unit_bytes=100, slot_bytes=250, image_bytes=250, layout_id="t")


def _ops(batch_id=1, relocations=(), stores=(), restores=()) -> StateMaintenanceOps:
    return StateMaintenanceOps(batch_id, tuple(relocations), tuple(stores), tuple(restores))


# -- the unit table ------------------------------------------------------------------------------


def test_unit_table_coalesces_runs_that_advance_together():
    ops = _ops(stores=[StoreOp("a", 2, None, (5, 6, 9))])
    table = plan_unit_table(ops, SPEC, num_pool_units=20, num_slots=4)
    # Slot 2's image is units 20 + 2 * 3 = 26, 27, 28.
    assert table.rows.tolist() == [[26, 5, 2], [28, 9, 1]]
    assert table.num_units == 3


def test_unit_table_restore_and_relocation_rows():
    ops = _ops(
        relocations=[RelocateOp("r", 0, 3)],
        restores=[RestoreOp("b", 1, None, (11, 12, 13))],
    )
    table = plan_unit_table(ops, SPEC, num_pool_units=20, num_slots=4)
    assert table.rows.tolist() == [[20, 29, 3], [11, 23, 3]]


def test_a_row_never_straddles_two_slot_images():
    ops = _ops(stores=[StoreOp("a", 0, None, (0, 1, 2)), StoreOp("b", 1, None, (3, 4, 5))])
    table = plan_unit_table(ops, SPEC, num_pool_units=20, num_slots=4)
    assert table.rows.tolist() == [[20, 0, 3], [23, 3, 3]]


def test_unit_table_refuses_rows_that_would_race_in_one_launch():
    restore = RestoreOp("b", 1, None, (11, 12, 13))
    with pytest.raises(RuntimeError, match="read and written by one launch"):
        plan_unit_table(_ops(relocations=[RelocateOp("b", 1, 2)], restores=[restore]), SPEC, 20, 4)
    with pytest.raises(RuntimeError, match="written twice"):
        plan_unit_table(_ops(relocations=[RelocateOp("a", 0, 1)], restores=[restore]), SPEC, 20, 4)
    with pytest.raises(ValueError, match="^unit: 20 outside the KV pool"):
        plan_unit_table(_ops(stores=[StoreOp("a", 0, None, (18, 19, 20))]), SPEC, 20, 4)
    with pytest.raises(ValueError, match="^slot: 4 outside the slot pool"):
        plan_unit_table(_ops(stores=[StoreOp("a", 4, None, (1, 2, 3))]), SPEC, 20, 4)


def test_padded_table_has_fixed_rows_that_copy_nothing():
    table = plan_unit_table(_ops(stores=[StoreOp("a", 2, None, (5, 6, 9))]), SPEC, 20, 4)
    padded = table.padded(4)
    assert padded.tolist() == [[26, 5, 2], [28, 9, 1], [0, 0, 0], [0, 0, 0]]
    with pytest.raises(ValueError, match="^max_rows"):
        table.padded(1)


def test_uint8_rows_is_a_view_of_the_same_memory():
    t = torch.zeros((3, 2, 5), dtype=torch.bfloat16)
    rows = uint8_rows(t)
    assert rows.shape == (3, 20) and rows.dtype == torch.uint8
    rows[1].fill_(0xFF)
    assert torch.isnan(t[1]).all() and (t[0] == 0).all() and (t[2] == 0).all()
    with pytest.raises(ValueError, match="not contiguous"):
        uint8_rows(t.transpose(0, 1))


# -- the torch reference executor ---------------------------------------------------------------


class _Pools:
    """A KV pool of per-layer K/V tensors and a slot pool of per-layer GDN state tensors, shaped as
    the engine holds them, with awkward sizes: the image does not fill its last unit."""

    def __init__(self, num_blocks=9, num_slots=5, device="cpu", kv_dtype=torch.float32):
        state = gated_deltanet_state_tensors(2, 10, 4, 2, 8, 5, torch.bfloat16, torch.float32)
        # 384-byte units whatever the KV dtype: head_dim 6 in fp32, 12 in bf16.
        self.plan = StatePoolPlan(8, 1, 1, 24 // kv_dtype.itemsize, kv_dtype, state)
        self.spec = PagedStateCheckpointSpec.from_plan(self.plan)
        g = torch.Generator().manual_seed(0)
        kv_shape = (num_blocks, 8, 1, self.plan.head_dim)
        self.kv = [
            torch.randn(kv_shape, generator=g).to(device=device, dtype=kv_dtype) for _ in range(2)
        ]
        self.state = [
            torch.randn((num_slots, *t.shape), generator=g).to(device=device, dtype=t.dtype)
            for t in state
        ]
        self.num_blocks, self.num_slots = num_blocks, num_slots

    def run(self, ops):
        table = plan_unit_table(ops, self.spec, self.num_blocks, self.num_slots)
        copy_units_reference(
            table,
            [uint8_rows(t) for t in self.kv],
            [uint8_rows(t) for t in self.state],
            self.spec,
        )


@pytest.mark.parametrize(
    "device, kv_dtype",
    [
        ("cpu", torch.float32),
        pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu),
    ],
)
def test_reference_store_then_restore_is_bitwise_exact(device, kv_dtype):
    pools = _Pools(device=device, kv_dtype=kv_dtype)
    assert pools.spec.page_unit_bytes == 384 and pools.spec.image_bytes == 760
    assert pools.spec.units_per_image == 2
    original = [t[1].clone() for t in pools.state]
    kv_before = [t.clone() for t in pools.kv]
    pools.run(_ops(stores=[StoreOp("a", 1, None, (7, 2))]))
    # Only the borrowed blocks changed in the KV pool.
    for before, after in zip(kv_before, pools.kv, strict=True):
        assert torch.equal(before[[0, 1, 3, 4, 5, 6, 8]], after[[0, 1, 3, 4, 5, 6, 8]])
        assert not torch.equal(before[[2, 7]], after[[2, 7]])
    others = [t[[0, 2, 4]].clone() for t in pools.state]
    for t in pools.state:
        t[1].zero_()
        t[3].zero_()
    pools.run(_ops(restores=[RestoreOp("b", 3, None, (7, 2))]))
    for want, t in zip(original, pools.state, strict=True):
        assert torch.equal(t[3].view(torch.uint8), want.view(torch.uint8))
        assert (t[1] == 0).all()  # the source slot was not touched by the restore
    for want, t in zip(others, pools.state, strict=True):
        assert torch.equal(t[[0, 2, 4]], want)


def test_reference_relocation_moves_a_slot_bitwise():
    pools = _Pools()
    original = [t[0].clone() for t in pools.state]
    pools.run(_ops(relocations=[RelocateOp("a", 0, 4)]))
    for want, t in zip(original, pools.state, strict=True):
        assert torch.equal(t[4].view(torch.uint8), want.view(torch.uint8))


def test_reference_executor_refuses_mismatched_segments():
    pools = _Pools()
    table = plan_unit_table(_ops(stores=[StoreOp("a", 1, None, (7, 2))]), pools.spec, 9, 5)
    slots = [uint8_rows(t) for t in pools.state]
    with pytest.raises(ValueError, match=r"^pool_segments: segments hold 192 bytes"):
        copy_units_reference(table, [uint8_rows(pools.kv[0])], slots, pools.spec)
    with pytest.raises(ValueError, match=r"^slot_segments\[0\]: expected a uint8"):
        copy_units_reference(table, [uint8_rows(t) for t in pools.kv], pools.state, pools.spec)


# -- the queue's lifetime invariants ------------------------------------------------------------


def _setup(num_blocks=40, max_units=12):
    store = StateCheckpointStore(
        BlockPool(num_blocks, BS), SPEC, max_units=max_units, min_free_blocks=0
    )
    return store, StateMaintenance(store)


def _ready_hit(store, maint, prefix_hash=7, batch=0):
    staged = store.stage(prefix_hash, BS)
    store.launch(staged.ref, batch)
    store.publish(batch)
    hit = store.lookup([prefix_hash], 1)
    store.acquire(hit.ref)  # admission pins right after the lookup
    return hit


def test_an_empty_batch_does_not_drain_or_unpin_a_queued_restore():
    store, maint = _setup()
    hit = _ready_hit(store, maint)
    maint.queue_restore("a", 2, hit)
    assert store.total_pins == 1
    assert maint.take_for_batch(1, num_scheduled=0) is None
    assert maint.batch_done(1).restored == []
    assert store.total_pins == 1 and maint.queued() == (0, 1, 0)
    ops = maint.take_for_batch(2, num_scheduled=3)
    assert [op.seq_id for op in ops.restores] == ["a"]
    assert store.total_pins == 1  # pinned while the launch runs
    assert maint.batch_done(2).restored == ["a"]
    assert store.total_pins == 0 and store.counters.restored == 1


def test_a_queued_restore_keeps_its_source_pinned_until_it_rode_a_real_batch():
    store, maint = _setup(max_units=3)
    hit = _ready_hit(store, maint)
    maint.queue_restore("a", 2, hit)
    assert store.reclaim(3) == 0  # pinned: live KV cannot take it
    assert store.stage(99, BS) is None  # nor can a newer checkpoint
    maint.take_for_batch(1, 1)
    assert store.reclaim(3) == 0  # still pinned while in flight
    maint.batch_done(1)
    assert store.reclaim(3) == 3


def test_freeing_a_request_cancels_the_gather_aimed_at_its_slot_and_drops_its_pin():
    store, maint = _setup()
    hit = _ready_hit(store, maint)
    maint.queue_restore("a", 2, hit)
    assert maint.free_request("a", 2) == [2]
    assert store.total_pins == 0 and maint.queued() == (0, 0, 0)
    assert maint.take_for_batch(1, 1) is None
    assert store.counters.restored == 0


def test_a_restore_in_flight_when_its_request_is_freed_unpins_when_the_batch_ran():
    store, maint = _setup()
    hit = _ready_hit(store, maint)
    maint.queue_restore("a", 2, hit)
    maint.take_for_batch(1, 1)
    assert maint.free_request("a", 2) == []  # the launch still writes the slot
    assert store.total_pins == 1 and maint.held_slots == {2}
    outcome = maint.batch_done(1)
    assert outcome.released_slots == [2] and store.total_pins == 0


def test_a_vanished_checkpoint_raises_when_a_restore_is_queued():
    store, maint = _setup(max_units=3)
    hit = _ready_hit(store, maint, prefix_hash=7)
    store.release(hit.ref)  # looked up and pinned, then given up
    assert store.reclaim(3) == 3  # live KV took it
    with pytest.raises(RuntimeError, match="vanished"):
        maint.queue_restore("a", 2, hit)
    with pytest.raises(RuntimeError, match="vanished"):
        store.acquire(hit.ref)
    assert maint.queued() == (0, 0, 0)


def test_a_restore_queued_without_a_pin_is_refused():
    store, maint = _setup()
    hit = _ready_hit(store, maint)
    store.release(hit.ref)
    with pytest.raises(RuntimeError, match="without a pin"):
        maint.queue_restore("a", 2, hit)


def test_a_store_rides_the_first_real_batch_after_the_one_that_reached_the_boundary():
    store, maint = _setup()
    staged = store.stage(42, BS)
    maint.queue_store("a", 3, staged, after_batch=5)
    assert maint.take_for_batch(5, 1) is None  # batch 5 computes the state it must copy
    assert maint.take_for_batch(6, 0) is None  # empty: nothing launched
    assert store.is_pending_copy(staged.ref)
    ops = maint.take_for_batch(7, 2)
    assert [op.ref for op in ops.stores] == [staged.ref]
    assert maint.take_for_batch(8, 2) is None  # drained exactly once
    assert store.lookup([42], 1) is None
    assert maint.batch_done(7).published == [staged.ref]
    assert store.lookup([42], 1).ref == staged.ref


def test_batch_ids_must_increase():
    store, maint = _setup()
    maint.take_for_batch(3, 1)
    with pytest.raises(ValueError, match="^batch_id: 3 is not after"):
        maint.take_for_batch(3, 1)


def test_a_freed_requests_slot_is_held_until_its_queued_store_has_run():
    store, maint = _setup()
    staged = store.stage(42, BS)
    maint.queue_store("a", 4, staged, after_batch=0)
    assert maint.free_request("a", 4) == []
    assert maint.held_slots == {4}
    maint.take_for_batch(1, 1)
    outcome = maint.batch_done(1)
    assert outcome.released_slots == [4] and outcome.published == [staged.ref]
    assert maint.held_slots == set()


def test_a_store_cancelled_while_queued_is_skipped_and_its_slot_released():
    store, maint = _setup()
    staged = store.stage(42, BS)
    maint.queue_store("a", 4, staged, after_batch=0)
    maint.queue_store("b", 5, store.stage(43, BS), after_batch=0)
    assert maint.free_request("b", 5) == []
    assert store.reclaim(6) == 6  # live KV takes both queued copies back
    assert maint.take_for_batch(1, 1) is None  # the stale ops launch nothing
    assert maint.batch_done(1).released_slots == [5]
    assert maint.free_request("a", 4) == [4]
    assert store.units_in_use == 0 and store.counters.dropped == 2


def test_async_batches_settle_independently():
    store, maint = _setup()
    hit = _ready_hit(store, maint)
    maint.queue_restore("a", 1, hit)
    first = maint.take_for_batch(1, 1)
    staged = store.stage(50, BS)
    maint.queue_store("a", 1, staged, after_batch=1)
    second = maint.take_for_batch(2, 1)  # scheduled while batch 1 still runs
    assert len(first.restores) == 1 and len(second.stores) == 1
    assert maint.batch_done(1).restored == ["a"] and store.total_pins == 0
    assert store.state_of(staged.ref) is CheckpointState.COPYING
    assert maint.batch_done(2).published == [staged.ref]


def test_a_relocation_hands_back_its_source_slot_after_it_ran():
    store, maint = _setup()
    maint.queue_relocation("a", 1, 3)
    ops = maint.take_for_batch(1, 1)
    assert ops.relocations == (RelocateOp("a", 1, 3),)
    assert maint.batch_done(1).released_slots == [1]
    assert maint.free_request("a", 3) == [3]


def test_freeing_a_request_cancels_its_queued_relocation():
    store, maint = _setup()
    maint.queue_relocation("a", 1, 3)
    assert maint.free_request("a", 3) == [1, 3]
    assert maint.take_for_batch(1, 1) is None


def test_a_second_gather_into_one_slot_is_refused():
    store, maint = _setup()
    hit = _ready_hit(store, maint)
    maint.queue_restore("a", 2, hit)
    store.acquire(hit.ref)
    with pytest.raises(RuntimeError, match="already queued"):
        maint.queue_restore("b", 2, hit)
    store.release(hit.ref)
    assert store.total_pins == 1


def test_a_flush_carries_copies_that_hold_slots_when_nothing_can_be_scheduled():
    store, maint = _setup()
    staged = store.stage(42, BS)
    maint.queue_store("a", 0, staged, after_batch=1)
    assert maint.needs_flush is False  # the request still owns its slot
    assert maint.free_request("a", 0) == []
    assert maint.needs_flush is True  # slot 0 waits on a copy no batch carries yet
    assert maint.take_for_batch(2, 0) is None  # an empty batch still drains nothing
    ops = maint.take_for_batch(3, 0, flush=True)
    assert [op.ref for op in ops.stores] == [staged.ref]
    assert maint.needs_flush is False  # in flight now: batch_done will release it
    outcome = maint.batch_done(3)
    assert outcome.released_slots == [0] and outcome.published == [staged.ref]


def test_a_store_queued_after_a_later_batch_was_taken_is_refused():
    store, maint = _setup()
    maint.take_for_batch(5, 1)
    maint.take_for_batch(6, 1)  # may have advanced the slot past batch 5's boundary
    staged = store.stage(42, BS)
    with pytest.raises(RuntimeError, match="queued too late"):
        maint.queue_store("a", 0, staged, after_batch=5)
    maint.queue_store("a", 0, staged, after_batch=6)  # right after the batch that reached it
    assert maint.queued() == (1, 0, 0)

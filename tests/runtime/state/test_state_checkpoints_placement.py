"""Checkpoint placement policy (contract 6): the interval flag and its snapping, demand on/off
(flag over environment), prefill chunks cut to land on rungs, anchors and demand rungs, decode
rungs held to spacing, one pending boundary per sequence, unschedulable requests reported."""

from __future__ import annotations

import logging
import random

import pytest

from atom_runtime.state.placement import (
    DEMAND_ENV,
    CheckpointPlacement,
    ChunkPlan,
    resolve_demand,
    snap_interval,
)

BS = 16


def _placement(interval, demand=None, environ=None, decode_anchors=True) -> CheckpointPlacement:
    return CheckpointPlacement(
        interval, BS, demand, decode_anchors=decode_anchors, environ=environ or {}
    )


def test_the_demand_flag_wins_over_the_environment():
    assert resolve_demand(False, {DEMAND_ENV: "1"}) is False
    assert resolve_demand(True, {DEMAND_ENV: "0"}) is True
    assert resolve_demand(None, {DEMAND_ENV: "off"}) is False
    assert resolve_demand(None, {DEMAND_ENV: "Yes"}) is True
    assert resolve_demand(None, {}) is True  # on by default
    with pytest.raises(ValueError, match=f"^{DEMAND_ENV}: expected"):
        resolve_demand(None, {DEMAND_ENV: "maybe"})
    assert _placement(-1, environ={DEMAND_ENV: "0"}).demand_enabled is False
    assert _placement(-1, demand=True, environ={DEMAND_ENV: "0"}).demand_enabled is True


def test_interval_snaps_up_to_the_hash_block_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="atom_runtime.state.placement"):
        assert snap_interval(100, BS) == 112
    assert "placed every 112 tokens" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="atom_runtime.state.placement"):
        assert snap_interval(512, BS) == 512
        assert snap_interval(0, BS) == 0
        assert snap_interval(-1, BS) == -1
    assert caplog.text == ""
    with pytest.raises(ValueError, match="^state_checkpoint_interval_tokens"):
        snap_interval(-2, BS)


def test_interval_zero_places_nothing_and_declines_demand():
    p = _placement(0)
    assert not p.enabled and not p.demand_enabled
    assert p.plan_prefill_chunk("a", 0, 100, 64) == ChunkPlan(64)
    assert p.anchor(100) is None and p.decode_boundary("a", 512) is None
    assert p.note_admission("a", 64, 0) is False
    assert p.counters.demands_declined == 1
    assert p.counters.hit_lost_tokens == 64 and p.counters.prefix_hit_tokens == 0


def test_prefill_chunks_are_cut_to_land_on_rungs_then_the_anchor():
    p = _placement(48)  # rungs 48, 96, ...; a 90-token prompt anchors at 80
    assert p.plan_prefill_chunk("a", 0, 90, 1000) == ChunkPlan(48, 48, "rung", True)
    assert p.plan_prefill_chunk("a", 48, 90, 1000) == ChunkPlan(32, 80, "anchor", True)
    assert p.plan_prefill_chunk("a", 80, 90, 1000) == ChunkPlan(10)
    assert (p.counters.chunks_cut_rung, p.counters.chunks_cut_anchor) == (1, 1)


def test_a_chunk_that_ends_on_a_boundary_is_not_counted_as_cut():
    p = _placement(48)
    assert p.plan_prefill_chunk("a", 0, 90, 48) == ChunkPlan(48, 48, "rung", False)
    assert p.counters.chunks_cut_rung == 0


def test_a_budget_short_of_the_next_boundary_runs_whole():
    p = _placement(48)
    assert p.plan_prefill_chunk("a", 0, 90, 20) == ChunkPlan(20)
    assert p.plan_prefill_chunk("a", 20, 90, 20) == ChunkPlan(20)
    assert p.plan_prefill_chunk("a", 40, 90, 20) == ChunkPlan(8, 48, "rung", True)


def test_minus_one_places_no_ladder_but_anchors_and_demand_rungs():
    p = _placement(-1)
    assert p.next_rung(0) is None
    assert p.decode_boundary("a", 4096) == (4096, "decode_anchor")  # every block boundary
    assert p.decode_boundary("a", 4100) is None  # mid-block
    # A known end (the state reaches at most last_computed): only the last boundary before it.
    assert p.decode_boundary("a", 4096, last_computed=4111) == (4096, "decode_anchor")
    assert p.decode_boundary("a", 4096, last_computed=4112) is None  # 4112 comes after it
    assert p.decode_boundary("a", 4096, last_computed=4096) == (4096, "decode_anchor")
    assert p.note_admission("a", 64, 0) is True
    assert p.plan_prefill_chunk("a", 0, 200, 1000) == ChunkPlan(64, 64, "demand", True)
    assert p.pending("a") is None
    assert p.plan_prefill_chunk("a", 64, 200, 1000) == ChunkPlan(128, 192, "anchor", True)
    assert p.plan_prefill_chunk("a", 192, 200, 1000) == ChunkPlan(8)
    assert p.counters.demands_recorded == 1 and p.counters.chunks_cut_demand == 1


def test_the_anchor_is_the_prompts_last_block_boundary_even_on_a_recompute():
    p = _placement(-1)
    assert p.anchor(15) is None  # no full block: nothing to anchor
    assert p.anchor(16) == 16 and p.anchor(47) == 32
    # Recompute after preemption prefills prompt + output (70 tokens); the anchor stays at 32.
    assert p.plan_prefill_chunk("a", 0, 70, 1000, prompt_len=40) == ChunkPlan(
        32, 32, "anchor", True
    )
    assert p.plan_prefill_chunk("a", 32, 70, 1000, prompt_len=40) == ChunkPlan(38)


def test_one_pending_boundary_per_sequence_the_newer_wins():
    p = _placement(-1)
    assert p.note_admission("a", 32, 0)
    assert p.note_admission("a", 96, 0)  # re-admitted (say after a preemption)
    assert p.pending("a") == 96
    assert p.counters.dropped == 1 and p.counters.demands_recorded == 2
    assert p.plan_prefill_chunk("a", 0, 300, 1000).boundary == 96


def test_a_pending_boundary_behind_the_sequence_is_dropped_not_waited_for():
    p = _placement(-1)
    p.note_admission("a", 64, 0)
    # The sequence resumed at 128 (a deeper checkpoint appeared): the demand can never be reached.
    plan = p.plan_prefill_chunk("a", 128, 300, 1000)
    assert plan == ChunkPlan(160, 288, "anchor", True)
    assert p.pending("a") is None and p.counters.dropped == 1


def test_no_demand_where_a_ladder_rung_already_sits_or_where_the_checkpoint_reached_the_hit():
    p = _placement(32)
    assert p.note_admission("a", 64, 0) is False  # 64 is a rung
    assert p.note_admission("b", 64, 64) is False  # resumed at the whole hit: nothing lost
    assert p.counters.demands_recorded == 0 and p.counters.demands_declined == 0
    assert p.counters.prefix_hit_tokens == 64 and p.counters.hit_lost_tokens == 64
    with pytest.raises(ValueError, match="^resume_tokens"):
        p.note_admission("c", 32, 64)
    with pytest.raises(ValueError, match="^kv_hit_tokens"):
        p.note_admission("c", 33, 0)


def test_demand_switched_off_declines_and_places_only_the_ladder():
    p = _placement(-1, demand=False)
    assert p.note_admission("a", 64, 0) is False
    assert p.counters.demands_declined == 1
    assert p.plan_prefill_chunk("a", 0, 200, 1000) == ChunkPlan(192, 192, "anchor", True)


def test_decode_checkpoints_are_held_to_spacing():
    p = _placement(512)
    # Prefill of a 1000-token prompt placed rung 512 and the anchor 992.
    assert p.plan_prefill_chunk("a", 0, 1000, 4096).boundary == 512
    assert p.plan_prefill_chunk("a", 512, 1000, 4096).boundary == 992
    assert p.decode_boundary("a", 1000) is None  # not a block boundary
    # A rung 32 tokens after the anchor is held back; it is still a (rolling) decode anchor.
    assert p.decode_boundary("a", 1024) == (1024, "decode_anchor")
    assert p.decode_boundary("a", 1536) == (1536, "rung")
    assert p.decode_boundary("a", 1552) == (1552, "decode_anchor")
    assert p.decode_boundary("b", 512) == (512, "rung")  # a sequence with nothing placed yet
    off = _placement(512, decode_anchors=False)
    assert off.decode_boundary("a", 1552) is None and off.decode_boundary("a", 1536) == (
        1536,
        "rung",
    )


def test_forget_drops_the_pending_boundary_and_counts_it():
    p = _placement(-1)
    p.note_admission("a", 64, 0)
    p.forget("a")
    assert p.pending("a") is None and p.counters.dropped == 1
    p.forget("a")
    assert p.counters.dropped == 1


def test_chunk_plans_always_make_progress_and_land_on_block_boundaries():
    rng = random.Random(7)
    for interval in (-1, 16, 48, 100, 512):
        p = _placement(interval)
        for i in range(400):
            seq = f"s{i % 5}"
            target = rng.randint(1, 3000)
            computed = rng.randint(0, target - 1)
            budget = rng.randint(1, 700)
            if rng.random() < 0.3:
                p.note_admission(seq, rng.randint(0, target // BS) * BS, 0)
            plan = p.plan_prefill_chunk(seq, computed, target, budget)
            natural = min(target - computed, budget)
            assert 1 <= plan.num_tokens <= natural
            assert plan.cut == (plan.num_tokens < natural)
            if plan.boundary is None:
                assert plan.num_tokens == natural
            else:
                assert plan.boundary == computed + plan.num_tokens
                assert plan.boundary % BS == 0
            if plan.cut:
                assert plan.boundary is not None


def test_a_request_that_cannot_run_under_the_policy_is_reported_once(caplog):
    p = _placement(512)
    assert p.schedulability_warning("a", 97 * BS, 100, 3) is None
    with caplog.at_level(logging.WARNING, logger="atom_runtime.state.placement"):
        msg = p.schedulability_warning("b", 101 * BS, 100, 3)
        assert p.schedulability_warning("b", 101 * BS, 100, 3) == msg
    assert "needs 101 KV blocks" in msg and "can never be scheduled" in msg
    assert caplog.text.count("can never be scheduled") == 1
    msg = p.schedulability_warning("c", 98 * BS, 100, 3)
    assert "runs without checkpoints" in msg

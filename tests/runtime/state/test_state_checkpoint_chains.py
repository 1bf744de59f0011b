"""Conversation chains (state/chains.py): which checkpoints a newer one of the same
conversation supersedes, as pure bookkeeping over refs."""

from __future__ import annotations

from atom_runtime.state.chains import CheckpointChains
from atom_runtime.state.checkpoint_record import CheckpointRef


def ref(i: int) -> CheckpointRef:
    return CheckpointRef(i, 0)


def test_decode_anchors_roll_and_a_rung_ends_the_roll_but_stays():
    c = CheckpointChains()
    c.staged("a", "anchor", ref(1))
    c.staged("a", "decode_anchor", ref(2))
    c.staged("a", "decode_anchor", ref(3))
    assert c.published([ref(2)]) == []  # the first decode anchor replaces no anchor
    assert c.published([ref(3)]) == [ref(2)]
    c.staged("a", "rung", ref(4))
    c.staged("a", "decode_anchor", ref(5))
    assert c.published([ref(4), ref(5)]) == [ref(3)]  # the rung is not superseded
    c.staged("a", "demand", ref(6))
    assert c.published([ref(6)]) == []


def test_the_next_turns_prompt_anchor_replaces_the_answer_end_and_its_prompt_anchor():
    c = CheckpointChains()
    c.staged("t0", "anchor", ref(1))
    c.staged("t0", "decode_anchor", ref(2))
    c.forget("t0")
    c.resumed("t1", ref(2), from_decode=True)
    c.staged("t1", "anchor", ref(3))
    assert c.published([ref(3)]) == [ref(2), ref(1)]
    # A request resuming from a checkpoint that is not an answer end (a shared system prompt's
    # demand rung) supersedes nothing with its anchor.
    c.resumed("other", ref(9), from_decode=False)
    c.staged("other", "anchor", ref(10))
    assert c.published([ref(10)]) == []


def test_nothing_is_superseded_for_a_successor_that_never_became_ready():
    c = CheckpointChains()
    c.staged("a", "decode_anchor", ref(1))
    c.staged("a", "decode_anchor", ref(2))  # would supersede 1 once READY...
    c.prune(lambda r: r != ref(2))  # ...but it was dropped before its copy ran
    assert c.published([ref(2)]) == []

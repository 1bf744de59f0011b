"""State checkpoints in the engine (issue 15), on tiny random hybrid models, fp32 on CPU.

Pinned: a request resumed from a checkpoint gives the greedy tokens of one that recomputes its
prefix, and its slot ends the prompt bitwise equal to the recompute's (same chunk splits); the
image a checkpoint holds, restored by the engine's own copy launch into a spare slot, is
bitwise the state of the prefix recomputed alone; the byte table the launch runs copies exactly
what the torch reference of the unit table copies; a shared system prompt shorter than the
ladder spacing comes back through a demand rung; a multi-turn follow-up resumes at the
previous prompt's anchor; and a randomized run with arrivals, aborts, preemptions and
reclaims under a tiny pool keeps the store's invariants after every step and ends with no pin,
no held slot and (after a prefix-cache reset) no borrowed unit.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from atom_runtime import LLM, SamplingParams
from atom_runtime.kv_events import BlockRemoved, BlockStored
from atom_runtime.protocol.block_hash import hash_block_tokens, hash_token_blocks
from atom_runtime.protocol.engine_core import EngineRequest
from atom_runtime.state.checkpoint_spec import PagedStateCheckpointSpec
from atom_runtime.state.copy_plan import StateCopyPlan
from atom_runtime.state.maintenance import UnitCopyTable, copy_units_reference, uint8_rows

pytestmark = pytest.mark.timeout(300)

BS = 16


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def _run(llm: LLM, prompt: list[int], n: int):
    return llm.generate({"prompt_token_ids": prompt}, _greedy(n), use_tqdm=False)[0]


def _record_slots(llm: LLM) -> dict[str, int]:
    """request id -> the slot it was given (a spy around the real slot pool)."""
    pool = llm.engine.state_pool
    seen: dict[str, int] = {}
    allocate = pool.allocate

    def spy(seq):
        ok = allocate(seq)
        if ok:
            seen[seq.request_id] = seq.state_slots[0]
        return ok

    pool.allocate = spy
    return seen


def _slot_state(llm: LLM, slot: int) -> list[torch.Tensor]:
    state = llm.engine.executor.state
    return [t[slot].clone() for layer in state.layers for t in (layer.conv_state, layer.ssm_state)]


def _assert_idle(llm: LLM) -> None:
    ck = llm.engine.checkpoints
    assert ck.store.total_pins == 0
    assert not ck.maint.held_slots
    assert llm.engine.state_pool.num_in_use == 0
    ck.store.check_invariants()


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_restore_gives_the_tokens_and_the_state_of_a_recompute(tiny_hybrid_models, kind):
    folder = str(tiny_hybrid_models[kind])
    prompt = _tokens(1, 47)  # anchor of the 40-token first turn: 32; KV hit of this one: 32
    resumed = LLM(folder, dtype="float32", num_gpu_blocks_override=64)
    slots = _record_slots(resumed)
    first = _run(resumed, prompt[:40], 4)
    assert first.num_cached_tokens == 0
    out = _run(resumed, prompt, 1)
    assert out.num_cached_tokens == 32
    resumed_state = _slot_state(resumed, slots[out.request_id])
    c = resumed.engine.checkpoints.counters
    assert c.stored >= 1 and c.restored == 1 and c.prefix_hit_tokens == 32

    # Recompute with the same chunk splits ([0, 32) then [32, 47)): no checkpoints, 32-token
    # budget.
    recompute = LLM(
        folder,
        dtype="float32",
        num_gpu_blocks_override=64,
        max_num_batched_tokens=32,
        state_checkpoint_interval_tokens=0,
    )
    rslots = _record_slots(recompute)
    ref = _run(recompute, prompt, 1)
    assert ref.num_cached_tokens == 0
    assert ref.outputs[0].token_ids == out.outputs[0].token_ids
    for got, want in zip(
        resumed_state, _slot_state(recompute, rslots[ref.request_id]), strict=True
    ):
        assert torch.equal(got, want)

    # Longer generations: identical greedy tokens resumed and recomputed.
    again = _run(resumed, prompt, 8)
    assert again.num_cached_tokens == 32
    assert again.outputs[0].token_ids == _run(recompute, prompt, 8).outputs[0].token_ids
    _assert_idle(resumed)


def test_a_checkpoint_image_is_bitwise_the_recomputed_prefix_state(tiny_hybrid_models):
    folder = str(tiny_hybrid_models["qwen3_5_moe"])
    prompt = _tokens(2, 40)
    llm = LLM(folder, dtype="float32", num_gpu_blocks_override=64, max_num_seqs=4)
    _run(llm, prompt, 3)  # stores the anchor at 32
    ck = llm.engine.checkpoints
    hit = ck.store.lookup(hash_token_blocks(prompt[:32], BS), 2)
    assert hit is not None and hit.num_tokens == 32
    # The engine's own launch gathers the image into a slot nobody uses.
    spare = llm.engine.state_pool.num_slots - 1
    base = llm.engine.pool.num_blocks + spare * ck.spec.units_per_image
    rows = np.array([[u, base + k, 1] for k, u in enumerate(hit.units)], dtype=np.int64)
    llm.engine.executor.copy_state(rows)
    image = _slot_state(llm, spare)

    alone = LLM(folder, dtype="float32", num_gpu_blocks_override=64, max_num_seqs=4)
    slots = _record_slots(alone)
    ref = _run(alone, prompt[:32], 1)
    for got, want in zip(image, _slot_state(alone, slots[ref.request_id]), strict=True):
        assert torch.equal(got, want)


def test_the_byte_table_copies_what_the_unit_table_reference_copies():
    torch.manual_seed(0)
    nb, ns = 12, 4
    kv = [torch.randn(nb, 2, 1, 2) for _ in range(4)]  # 16-byte rows: 64-byte units
    state = [torch.randn(ns, 5, 3), torch.randn(ns, 2, 4, 4).double(), torch.randn(ns, 7)]
    pool, slots = [uint8_rows(t) for t in kv], [uint8_rows(t) for t in state]
    image = sum(s.shape[1] for s in slots)  # 344 bytes: 6 units, the last one part padding
    spec = PagedStateCheckpointSpec(64, image, image, "test")
    per = spec.units_per_image
    # A store (slot 1 -> blocks 0..5), a restore in two runs (blocks 8, 9, 11 -> slot 2) and a
    # relocation (slot 3 -> slot 0).
    rows = torch.tensor(
        [
            [nb + per, 0, per],
            [8, nb + 2 * per, 2],
            [11, nb + 2 * per + 2, 1],
            [nb + 3 * per, nb, per],
        ]
    )
    want_kv, want_state = [t.clone() for t in kv], [t.clone() for t in state]
    copy_units_reference(
        UnitCopyTable(rows, nb, ns, per, 64),
        [uint8_rows(t) for t in want_kv],
        [uint8_rows(t) for t in want_state],
        spec,
    )
    plan = StateCopyPlan(pool, slots, spec)
    assert plan.unit_bytes == 4
    plan.run(rows)
    for got, want in zip(state, want_state, strict=True):
        assert torch.equal(got, want)
    # Pool blocks: the image bytes are the reference's; the last unit's padding is not written.
    for got, want in zip(kv, want_kv, strict=True):
        assert torch.equal(got[:5], want[:5]) and torch.equal(got[6:], want[6:])
    with pytest.raises(ValueError, match="pool segments hold"):
        StateCopyPlan(pool[:3], slots, spec)


def test_a_shared_system_prompt_shorter_than_the_spacing_comes_back_by_demand(
    tiny_hybrid_models,
):
    llm = LLM(
        str(tiny_hybrid_models["qwen3_5"]),
        dtype="float32",
        num_gpu_blocks_override=128,
        state_checkpoint_interval_tokens=512,  # a ladder far coarser than the system prompt
    )
    system = _tokens(3, 40)
    # Tails of 10+ tokens put each prompt-end anchor at 48, past the shared 32.
    outs = [_run(llm, system + _tokens(10 + i, 10 + 3 * i), 2) for i in range(3)]
    # The first sees nothing; the second hits the KV of the first 2 blocks but no checkpoint,
    # records a demand there and stops on it; the third resumes there.
    assert [o.num_cached_tokens for o in outs] == [0, 0, 32]
    c = llm.engine.checkpoints.counters
    assert c.demands_recorded >= 1 and c.chunks_cut_demand >= 1
    assert c.hit_lost_tokens >= 32 and c.prefix_hit_tokens == 32
    _assert_idle(llm)


def test_demand_rungs_follow_the_environment_unless_the_flag_says(tiny_hybrid_models, monkeypatch):
    monkeypatch.setenv("ATOM_STATE_CHECKPOINT_DEMAND", "0")
    folder = str(tiny_hybrid_models["qwen3_5"])
    off = LLM(folder, dtype="float32", num_gpu_blocks_override=64)
    assert not off.engine.checkpoints.placement.demand_enabled
    on = LLM(folder, dtype="float32", num_gpu_blocks_override=64, state_checkpoint_demand=True)
    assert on.engine.checkpoints.placement.demand_enabled


def test_the_checkpoint_memory_fraction_caps_the_store(tiny_hybrid_models, caplog):
    """--state-checkpoint-memory-fraction sets the share of the pool checkpoints may borrow (a
    tenth by default); one too small for a single image says so, naming the flag."""
    folder = str(tiny_hybrid_models["qwen3_5"])
    default = LLM(folder, dtype="float32", num_gpu_blocks_override=200)
    assert default.engine.checkpoints.store.max_units == 20
    wide = LLM(
        folder, dtype="float32", num_gpu_blocks_override=200, state_checkpoint_memory_fraction=0.35
    )
    assert (
        wide.engine.checkpoints.store.max_units == 70
        and wide.engine.checkpoints.store.can_ever_store
    )
    with caplog.at_level("WARNING"):
        tiny = LLM(
            folder, dtype="float32", num_gpu_blocks_override=200,
            state_checkpoint_memory_fraction=0.001,
        )  # fmt: skip
    assert not tiny.engine.checkpoints.store.can_ever_store
    assert "--state-checkpoint-memory-fraction" in caplog.text
    with pytest.raises(ValueError, match=r"^state_checkpoint_memory_fraction: must be in \(0, 1\]"):
        LLM(folder, state_checkpoint_memory_fraction=0)


def test_a_multi_turn_follow_up_resumes_at_the_previous_prompt_end(tiny_hybrid_models):
    llm = LLM(str(tiny_hybrid_models["qwen3_next"]), dtype="float32", num_gpu_blocks_override=96)
    history = _tokens(4, 37)
    cached = []
    previous_anchor = 0
    for turn in range(3):
        out = _run(llm, history, 6)
        cached.append(out.num_cached_tokens)
        anchor = len(history) // BS * BS
        history = history + list(out.outputs[0].token_ids) + _tokens(20 + turn, 9)
        if turn:
            # The previous prompt's anchor is below this prompt's KV hit: resumed exactly there.
            assert out.num_cached_tokens == previous_anchor
        previous_anchor = anchor
    assert cached[0] == 0 and all(c > 0 for c in cached[1:])
    _assert_idle(llm)


def test_a_request_with_a_known_end_copies_its_answer_end_once(tiny_hybrid_models):
    """EOS ignored and no stop condition: the request's length alone ends it, so of its decode
    anchors only the last block boundary before that end is placed (the others would only be
    superseded). The same request with a stop token id that never comes places one at every
    boundary. Either way the follow-up turn resumes where the answer ended, with the same
    tokens."""
    folder = str(tiny_hybrid_models["qwen3_5"])
    prompt = _tokens(21, 25)  # state after decoding reaches 26 .. 84: boundaries 32, 48, 64, 80
    runs = {}
    for name in ("known end", "stop id"):
        extra = {}
        if name == "stop id":  # greedy gives the same answer, so an id it lacks never comes
            unused = next(t for t in range(3, 1000) if t not in runs["known end"][1])
            extra = {"stop_token_ids": [unused]}
        llm = LLM(folder, dtype="float32", num_gpu_blocks_override=160)
        params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, **extra)
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        ck = llm.engine.checkpoints
        stored = ck.counters.stored
        follow = prompt + list(out.outputs[0].token_ids) + _tokens(22, 10)
        again = _run(llm, follow, 3)
        runs[name] = (stored, out.outputs[0].token_ids, again.num_cached_tokens,
                      again.outputs[0].token_ids)  # fmt: skip
        _assert_idle(llm)
    assert runs["known end"][0] == 2  # the prompt anchor (16) and the answer end (80)
    assert runs["stop id"][0] == 5  # the prompt anchor and 32, 48, 64, 80
    assert runs["known end"][1:] == runs["stop id"][1:]
    assert runs["known end"][2] == 80  # resumed at the answer's last boundary


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_decode_rungs_are_stored_and_resumed_under_either_schedule(
    tiny_hybrid_models, async_scheduling
):
    """A ladder rung reached while decoding is checkpointed. Under async scheduling the step
    that reaches it runs a token still being sampled, so the block's hash is unknown when the
    step is scheduled: the store is staged one schedule later (the slot still holds the state at
    the rung). A follow-up that extends the generated text resumes at the deepest decode rung,
    with the tokens of an engine that recomputes the whole prefix."""
    folder = str(tiny_hybrid_models["qwen3_next"])
    kw = dict(dtype="float32", num_gpu_blocks_override=96, async_scheduling=async_scheduling)
    llm = LLM(folder, state_checkpoint_interval_tokens=32, **kw)
    assert llm.engine.async_scheduling is async_scheduling
    prompt = _tokens(7, 20)  # no rung inside the prompt; anchor at 16
    first = _run(llm, prompt, 60)  # decode passes the rungs 32 and 64 (20..79 computed)
    ck = llm.engine.checkpoints
    follow = prompt + list(first.outputs[0].token_ids) + _tokens(8, 5)
    resumed = _run(llm, follow, 8)
    assert resumed.num_cached_tokens == 64
    # The anchor at 16, the rung at 64, then the follow-up's own anchor at 80. The boundaries at
    # 32 (a rung held back: within one spacing of the anchor) and 48 would be decode anchors,
    # but the request's end is known (EOS ignored, 60 tokens) and a later boundary comes before
    # it, so neither is placed.
    assert (ck.counters.stored, ck.counters.evicted, ck.counters.dropped) == (3, 0, 0)
    fresh = LLM(folder, state_checkpoint_interval_tokens=0, **kw)
    assert resumed.outputs[0].token_ids == _run(fresh, follow, 8).outputs[0].token_ids
    _assert_idle(llm)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_follow_up_turn_resumes_where_the_previous_answer_ended(
    tiny_hybrid_models, async_scheduling
):
    """Each block boundary an answer reaches replaces the request's previous decode anchor, and
    the next turn's prompt anchor replaces the answer end it resumed from and the prompt anchor
    before it (state/chains.py). So each follow-up (the
    answer plus a new message) resumes at its whole KV hit, with no demand rung and nothing lost
    to the boundary; the conversation keeps two checkpoints, its latest prompt's anchor (what
    regenerating the last answer resumes from) and its latest answer end; the last turn gives a
    recompute's tokens."""
    folder = str(tiny_hybrid_models["qwen3_5"])
    kw = dict(dtype="float32", num_gpu_blocks_override=160, async_scheduling=async_scheduling)
    llm = LLM(folder, **kw)  # the default interval, -1
    ck = llm.engine.checkpoints
    # Every turn's prompt is 5 past a block boundary and its answer 44 tokens, so its last
    # decode step reaches a boundary: that copy is still queued when the request ends, and the
    # next admission finds it only because queued copies of ended requests run first.
    history = _tokens(9, 21)
    previous = 0
    for turn in range(3):
        out = _run(llm, history, 44)
        computed = len(history) + 43  # the last sampled token never runs
        assert computed % BS == 0
        if turn:
            assert out.num_cached_tokens == previous  # the whole KV hit
        assert ck.store.num_ready == 2  # the latest prompt's anchor and answer end
        previous = computed
        history = history + list(out.outputs[0].token_ids) + _tokens(10 + turn, 20)
    assert ck.counters.hit_lost_tokens == 0 and ck.counters.demands_recorded == 0
    assert ck.counters.evicted == ck.counters.stored - 2
    last_prompt = history[: -20 - 44]
    fresh = LLM(folder, state_checkpoint_interval_tokens=0, **kw)
    assert out.outputs[0].token_ids == _run(fresh, last_prompt, 44).outputs[0].token_ids
    again = _run(llm, last_prompt, 4)  # regenerate the last answer: from that prompt's anchor
    assert again.num_cached_tokens == len(last_prompt) // BS * BS
    _assert_idle(llm)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_random_traffic_under_a_tiny_pool_leaks_no_unit_pin_or_slot(
    tiny_hybrid_models, async_scheduling
):
    llm = LLM(
        str(tiny_hybrid_models["qwen3_5"]),
        dtype="float32",
        num_gpu_blocks_override=30,
        max_num_seqs=4,
        max_num_batched_tokens=40,
        max_model_len=160,
        state_checkpoint_interval_tokens=32,
        async_scheduling=async_scheduling,
    )
    engine = llm.engine
    ck = engine.checkpoints
    rng = random.Random(7)
    systems = [_tokens(30 + i, n) for i, n in enumerate((50, 75))]
    finished: list[list[int]] = []
    live: list[str] = []
    next_id = 0

    def check() -> None:
        ck.store.check_invariants()
        assert ck.store.total_pins == ck.maint.num_outstanding_restores
        lent = set(engine.pool.lent)
        held = {b for s in engine.scheduler.running for b in s.block_table}
        assert not lent & held

    for _ in range(120):
        r = rng.random()
        if r < 0.35 and len(live) < 8:
            if finished and rng.random() < 0.4:
                prompt = list(rng.choice(finished))[:100]
            else:
                prompt = list(rng.choice(systems))
            prompt += [rng.randrange(3, 1000) for _ in range(rng.randint(1, 30))]
            rid = f"r{next_id}"
            next_id += 1
            engine.add_request(
                EngineRequest(rid, prompt, _greedy(rng.randint(1, 160 - len(prompt))))
            )
            live.append(rid)
        elif r < 0.36 and live:
            engine.abort_requests([live.pop(rng.randrange(len(live)))])
        elif r < 0.40:
            ck.store.reclaim(rng.randint(1, 6))
        for rid in engine.step().finished():
            if rid in live:
                live.remove(rid)
        check()
        for seq in engine.scheduler.running:  # follow-up turns extend what ran
            if seq.num_tokens - seq.num_pending > 40 and rng.random() < 0.2:
                finished.append(list(seq.token_ids[: seq.num_tokens - seq.num_pending]))
    while engine.has_unfinished_requests():
        engine.step()
        check()
    for _ in range(3):  # copies that still hold slots ride maintenance-only launches
        engine.step()
    check()
    assert ck.store.total_pins == 0 and not ck.maint.held_slots
    assert engine.state_pool.num_in_use == 0
    assert engine.reset_prefix_cache()
    assert ck.store.units_in_use == 0 and not engine.pool.lent
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    c = ck.counters
    assert engine.scheduler.num_preemptions > 0
    assert c.stored > 0 and c.restored > 0 and c.prefix_hit_tokens > 0
    assert c.evicted > 0


def test_kv_events_of_attention_blocks_stay_as_without_checkpoints(tiny_hybrid_models, monkeypatch):
    """Checkpoints change nothing in the KV events (contract 4): blocks lent to checkpoints hold
    no hash and appear in no event; a request that resumes below its KV hit (no checkpoint at the
    hit yet) recomputes cached blocks without storing them again; replaying the events gives the
    pool's prefix index after every step, and every stored hash re-derives from its parent and
    tokens (contract 1). Lending's own evictions: test_block_pool.py."""
    llm = LLM(
        str(tiny_hybrid_models["qwen3_5"]),
        dtype="float32",
        num_gpu_blocks_override=40,  # small: cached blocks are evicted
        state_checkpoint_interval_tokens=512,
        kv_events_config=json.dumps({"enable_kv_cache_events": True, "publisher": "null"}),
    )
    engine = llm.engine
    events: list = []
    publish = engine.publisher.publish

    def record(batch):
        publish(batch)
        events.extend(batch)

    monkeypatch.setattr(engine.publisher, "publish", record)
    pool = engine.pool
    index: set[int] = set()
    removed = 0
    system = _tokens(3, 40)
    for i in range(12):
        prompt = system + _tokens(40 + i, 30 + 7 * (i % 6))
        engine.add_request(EngineRequest(f"r{i}", prompt, _greedy(4)))
        while engine.has_unfinished_requests():
            engine.step()
            for e in events:
                if isinstance(e, BlockStored):
                    assert not index & set(e.block_hashes), "a cached hash was stored again"
                    index |= set(e.block_hashes)
                    parent = e.parent_block_hash
                    for j, h in enumerate(e.block_hashes):
                        parent = hash_block_tokens(parent, e.token_ids[j * BS : (j + 1) * BS])
                        assert parent == h
                elif isinstance(e, BlockRemoved):
                    assert set(e.block_hashes) <= index, "removed a hash never stored"
                    index -= set(e.block_hashes)
                    removed += 1
                else:
                    raise AssertionError(f"unexpected event {e!r}")
            events.clear()
            assert index == set(pool.cached)
            assert all(pool.blocks[b].hash is None for b in pool.lent)
    assert removed  # the small pool evicts
    c = engine.checkpoints.counters
    # The second request hit 32 tokens of KV with no checkpoint there; the rest resumed.
    assert c.hit_lost_tokens == 32 and c.restored >= 10 and c.stored >= 2
    _assert_idle(llm)


@pytest.mark.parametrize(
    ("async_scheduling", "budget", "resumed"),
    [(False, None, 0), (True, None, 0), (True, 256, 32)],
    ids=["sync-one-chunk", "async-one-chunk", "async-chunked"],
)
def test_a_request_that_cannot_run_beside_its_checkpoint_is_warned_about_not_hung(
    tiny_hybrid_models, caplog, async_scheduling, budget, resumed
):
    """A 992-token prompt in a 64-block pool whose first 32 tokens have a READY checkpoint (3
    blocks). In one chunk its 62 blocks cannot fit beside the image it would pin until the
    restore has run, and waiting for blocks that only its own pin holds would never end: it is
    warned about at arrival and recomputes its prefix instead. Cut into chunks it fits while the
    pin lasts, and resumes."""
    llm = LLM(
        str(tiny_hybrid_models["qwen3_5"]),
        dtype="float32",
        num_gpu_blocks_override=64,
        max_num_batched_tokens=budget,
        async_scheduling=async_scheduling,
    )
    engine = llm.engine
    shared = _tokens(11, 40)
    _run(llm, shared, 1)  # its prompt-end anchor, at 32, is READY
    assert engine.checkpoints.store.num_ready == 1
    with caplog.at_level("WARNING", logger="atom_runtime.state.placement"):
        engine.add_request(EngineRequest("long", shared + _tokens(12, 952), _greedy(2)))
    assert "request long: its 63 KV blocks leave no room for a state checkpoint" in caplog.text
    seq = engine.scheduler.requests["long"]
    for _ in range(40):  # a deadlock guard: 18 steps at most are needed
        engine.step()
        if not engine.has_unfinished_requests():
            break
    assert seq.is_finished and seq.num_output_tokens == 2
    assert seq.num_cached_tokens == resumed
    _assert_idle(llm)


def test_pipeline_parallelism_is_refused_at_start_up(tiny_hybrid_models, monkeypatch):
    """Before anything loads, naming the field, and saying why a hybrid model's state needs
    every layer in one stage."""
    import atom_runtime.llm

    def no_engine(config):
        raise AssertionError("the engine was built")

    monkeypatch.setattr(atom_runtime.llm, "EngineCore", no_engine)
    hybrid = str(tiny_hybrid_models["qwen3_5"])
    with pytest.raises(ValueError, match="^pipeline_parallel_size: must be 1, got 2: ") as info:
        LLM(hybrid, pipeline_parallel_size=2)
    assert "pipeline parallelism is not supported" in str(info.value)
    assert "is a hybrid model, and its state slots and checkpoints need every layer in one " in (
        str(info.value)
    )
    with pytest.raises(ValueError, match="^pipeline_parallel_size: must be 1, got 0: ") as info:
        LLM(None, pipeline_parallel_size=0)  # the default model: Llama family, no state
    assert "hybrid" not in str(info.value)


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_restore_matches_recompute_on_gpu_in_bf16(tiny_hybrid_models, enforce_eager):
    """The Triton copy launch (outside the decode graphs, async scheduling on by default): a
    resumed request's tokens and end-of-prompt slot state equal a recompute's, bitwise."""
    folder = str(tiny_hybrid_models["qwen3_5"])
    prompt = _tokens(1, 47)
    common = dict(
        dtype="bfloat16", device="cuda", num_gpu_blocks_override=64, enforce_eager=enforce_eager
    )
    resumed = LLM(folder, **common)
    slots = _record_slots(resumed)
    _run(resumed, prompt[:40], 4)
    out = _run(resumed, prompt, 1)
    assert out.num_cached_tokens == 32
    got = _slot_state(resumed, slots[out.request_id])
    recompute = LLM(folder, max_num_batched_tokens=32, state_checkpoint_interval_tokens=0, **common)
    rslots = _record_slots(recompute)
    ref = _run(recompute, prompt, 1)
    assert ref.outputs[0].token_ids == out.outputs[0].token_ids
    for a, b in zip(got, _slot_state(recompute, rslots[ref.request_id]), strict=True):
        assert torch.equal(a, b)
    again = _run(resumed, prompt, 8)
    assert again.num_cached_tokens == 32
    assert again.outputs[0].token_ids == _run(recompute, prompt, 8).outputs[0].token_ids
    _assert_idle(resumed)

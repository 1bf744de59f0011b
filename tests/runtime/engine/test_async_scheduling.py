"""Async scheduling (step N+1 scheduled and launched before step N's samples are read back) gives
exactly what the synchronous loop gives: the same tokens, finish reasons, logprobs, prefix-cache
hashes and freed blocks, through stops, min_tokens, penalties (which force a read-back first),
seeded sampling, preemption, the context limit and aborts of requests in flight.

The CPU runs the same code path as the GPU (pending tokens filled from the last step's samples on
the device, one step in flight); only the overlap itself needs a GPU to pay off."""

from __future__ import annotations

import pytest

from atom_runtime import LLM, SamplingParams
from atom_runtime.protocol.engine_core import EngineRequest

PROMPTS = [
    [11, 22, 33, 44, 55],
    list(range(100, 141)),
    [7] * 19,
    list(range(300, 317)),
    [5, 9],
]


def _pair(tiny_models, **kw):
    model = str(tiny_models["qwen2"])
    kw.setdefault("num_gpu_blocks_override", 64)
    on = LLM(model, dtype="float32", async_scheduling=True, **kw)
    off = LLM(model, dtype="float32", async_scheduling=False, **kw)
    assert on.engine.async_scheduling and not off.engine.async_scheduling
    return on, off


@pytest.fixture(scope="module")
def engines(tiny_models):
    return _pair(tiny_models)


def _run(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [
        (o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason) for o in outs
    ]


def _params(free_first: list[int]) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=7, stop_token_ids=[free_first[3]]),
        SamplingParams(temperature=0, max_tokens=8, min_tokens=4, stop_token_ids=[free_first[4]]),
    ]


def test_same_tokens_and_finishes_as_the_synchronous_loop(engines):
    on, off = engines
    greedy = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    first = [t[0][0] for t in _run(off, PROMPTS, greedy)]
    params = _params(first)
    want = _run(off, PROMPTS, params)
    got = _run(on, PROMPTS, params)
    assert got == want
    assert want[3][1:] == ("stop", first[3])  # the stop token case really stopped
    assert len(want[4][0]) >= 4
    for llm in engines:
        assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_blocks
        assert llm.engine._in_flight is None
    assert on.engine.cached_block_hashes() == off.engine.cached_block_hashes()


def test_logprobs_and_penalties_match(engines):
    on, off = engines
    params = [
        SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=6, frequency_penalty=1.5, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=11, max_tokens=6, presence_penalty=1.0),
    ]
    prompts = PROMPTS[:3]
    want = off.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = on.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
    lp_w, lp_g = want[0].outputs[0].logprobs, got[0].outputs[0].logprobs
    assert len(lp_g) == 6
    for a, b in zip(lp_w, lp_g, strict=True):
        assert a.keys() == b.keys()
        assert all(abs(a[k] - b[k]) < 1e-5 for k in a)


def test_a_request_needing_its_history_skips_steps_instead_of_stalling_the_batch(engines):
    """Penalties (and a grammar's mask) need the previous token, which async scheduling has not
    read back when it prepares the next step. Such a request sits out the step while its token
    is in flight (it advances every other step); the others keep the pipeline: the engine never
    waits for a launched step before scheduling the next. Tokens stay those of the sync loop."""
    on, off = engines
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    hist = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, frequency_penalty=1.0)
    finished_at, tokens = {}, {}
    on.engine.add_request(EngineRequest("plain", PROMPTS[0], plain))
    on.engine.add_request(EngineRequest("hist", PROMPTS[1], hist))
    steps = 0
    while on.engine.has_unfinished_requests():
        steps += 1
        out = on.engine.step()
        for rid, new in out.tokens_by_request().items():
            tokens.setdefault(rid, []).extend(new)
        for rid in out.finished():
            finished_at[rid] = steps
    assert finished_at["plain"] <= 14  # one token a step, one step behind
    assert finished_at["hist"] >= 2 * 12 - 2  # one token every other step
    want = off.generate(
        [{"prompt_token_ids": PROMPTS[0]}, {"prompt_token_ids": PROMPTS[1]}],
        [plain, hist],
        use_tqdm=False,
    )
    assert [tokens["plain"], tokens["hist"]] == [w.outputs[0].token_ids for w in want]


def test_one_step_stays_in_flight_and_outputs_come_one_step_later(engines):
    on, off = engines
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for llm in engines:
        llm.engine.add_request(EngineRequest("late", PROMPTS[0], params))
    assert off.engine.step().token_ids != []  # prefill samples the first token at once
    assert not on.engine.step()  # ... which async reads back during the next step
    assert on.engine._in_flight is not None
    got, want = [], []
    while on.engine.has_unfinished_requests():
        got.append(on.engine.step())
    while off.engine.has_unfinished_requests():
        want.append(off.engine.step())
    assert [o.token_ids for o in got] == [[t] for t in _tokens(off, params)]
    assert len(want) == 2 and got[-1].finished()["late"].finish_reason == "length"


def _tokens(llm, params):
    return (
        llm.generate({"prompt_token_ids": PROMPTS[0]}, params, use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )


def test_preemption_under_a_small_cache(tiny_models):
    # 12 blocks of 16 tokens cannot hold five growing sequences: the tail gets preempted while
    # its step is still in flight, and must finish with the same tokens anyway.
    on, off = _pair(tiny_models, num_gpu_blocks_override=12)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = _run(off, PROMPTS, params)
    got = _run(on, PROMPTS, params)
    assert got == want
    assert on.engine.scheduler.num_preemptions > 0
    assert on.engine.pool.num_free_blocks == on.engine.pool.num_blocks


def test_context_limit_finishes_without_overrunning(tiny_models):
    on, off = _pair(tiny_models, max_model_len=32)
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    want = _run(off, [PROMPTS[2]], params)
    got = _run(on, [PROMPTS[2]], params)
    assert got == want
    assert got[0][1] == "length" and len(got[0][0]) == 32 - 19


def test_abort_while_in_flight(engines):
    on, off = engines
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine = on.engine
    engine.add_request(EngineRequest("keep", PROMPTS[1], params))
    engine.add_request(EngineRequest("drop", PROMPTS[3], params))
    outputs = [engine.step(), engine.step(), engine.step()]
    assert engine._in_flight is not None
    aborted = engine.abort_requests(["drop"])
    assert [(o.request_id, o.finish_reason) for o in aborted] == [("drop", "abort")]
    later = []
    while engine.has_unfinished_requests():
        later.append(engine.step())
    # Nothing more for the aborted request.
    assert {rid for o in later for rid in [*o.request_ids, *o.finished()]} == {"keep"}
    kept = [t for o in outputs + later for t in o.tokens_by_request().get("keep", [])]
    assert kept == _run(off, [PROMPTS[1]], params)[0][0]
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    # Aborting everything leaves nothing that counts as unfinished.
    engine.add_request(EngineRequest("gone", PROMPTS[0], params))
    engine.step()
    engine.abort_requests(["gone"])
    assert not engine.has_unfinished_requests()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_async_scheduling_is_refused_with_tensor_parallelism():
    from atom_runtime.config import EngineConfig

    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(async_scheduling=True, tensor_parallel_size=2)

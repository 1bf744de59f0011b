"""Speculative decoding under async scheduling (tiny random models, fp32, CPU), against the plain
synchronous engine: greedy output identical token for token with n-gram drafts (an oracle's,
accepted and rejected at chosen positions), a draft model and an MTP head (tiny Qwen3.5),
through chunked prefill, preemption, n > 1, stop strings, max_tokens inside an accepted run and
logprobs. And the schedule itself: a speculating sequence sits out the steps launched while its
own is in flight (alone, it runs every other step), a new prompt's prefill runs meanwhile, and
a sequence with a step in flight is never preempted."""

from __future__ import annotations

import pytest

from atom_runtime import LLM, SamplingParams
from atom_runtime.protocol.engine_core import EngineRequest
from tests.runtime.spec_decode.oracle import OracleDrafter, install

K = 3
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}  # fmt: skip
PROMPTS = [
    [11, 22, 33, 44, 55, 11, 22, 33, 44, 55, 11, 22] * 3,
    list(range(100, 137)),
    [7, 8, 9, 7, 8, 9, 300, 301, 7, 8] * 4,
    [5, 6] * 9,
    [40, 41, 42],
]
# Chunked prefill (16 tokens a step) and a cache too small for every sequence at once.
TIGHT = dict(dtype="float32", num_gpu_blocks_override=8, max_num_batched_tokens=16)
ROOMY = dict(dtype="float32", num_gpu_blocks_override=160, max_num_batched_tokens=16)
GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)


def _outputs(llm, params, prompts=PROMPTS):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs for o in outs]


def _ids(llm, params, prompts=PROMPTS):
    return [[c.token_ids for c in outs] for outs in _outputs(llm, params, prompts)]


def _plain(model, params, prompts=PROMPTS, **kw):
    llm = LLM(str(model), async_scheduling=False, **kw)
    try:
        return _outputs(llm, params, prompts)
    finally:
        llm.shutdown()


def _async_spec(model, spec, **kw):
    llm = LLM(str(model), async_scheduling=True, speculative_config=spec, **kw)
    assert llm.engine.async_scheduling and llm.engine.speculative is not None
    return llm


def _truth(want, prompts=PROMPTS):
    return {tuple(p): outs[0].token_ids for p, outs in zip(prompts, want, strict=True)}


def _assert_drained(llm):
    engine = llm.engine
    assert engine._in_flight is None and not engine.scheduler.has_unfinished()
    if engine.checkpoints is None:  # state checkpoints keep borrowed blocks
        assert engine.pool.num_free_blocks == engine.pool.num_blocks
    else:
        assert engine.state_pool.num_in_use == 0


@pytest.mark.parametrize("pattern", ["rotating", "first", "none"])
def test_ngram_oracle_under_preemption_and_chunked_prefill(tiny_models, pattern):
    wrong = {
        "rotating": lambda step, pos: (step + pos) % 3 == 0,
        "first": lambda step, pos: pos == 0,
        "none": lambda step, pos: False,
    }[pattern]
    want = _plain(tiny_models["qwen2"], GREEDY, **TIGHT)
    llm = _async_spec(tiny_models["qwen2"], NGRAM, **TIGHT)
    try:
        install(llm, OracleDrafter(_truth(want), K, wrong))
        assert _ids(llm, GREEDY) == [[o.token_ids for o in outs] for outs in want]
        assert llm.engine.scheduler.num_preemptions > 0
        stats = llm.engine.scheduler.spec_stats
        assert stats.num_draft_tokens > 0
        if pattern == "rotating":
            assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
        elif pattern == "first":
            assert stats.num_accepted_tokens == 0
        else:
            assert stats.num_accepted_tokens == stats.num_draft_tokens
        _assert_drained(llm)
    finally:
        llm.shutdown()


def test_seeded_sampling_under_preemption_is_the_plain_engines(tiny_models):
    """Seeded sampled output (n = 2: seeds 5 and 6) through async verify steps, preemption and
    chunked prefill: the plain synchronous engine's tokens (a seeded draw depends on its seed
    and position alone)."""
    params = SamplingParams(temperature=0.9, max_tokens=30, ignore_eos=True, seed=5, n=2)
    want = _plain(tiny_models["qwen2"], params, **TIGHT)
    llm = _async_spec(tiny_models["qwen2"], NGRAM, **TIGHT)
    try:
        rotating = lambda step, pos: (step + pos) % 3 == 0  # noqa: E731
        install(llm, OracleDrafter(_truth(want), K, rotating))
        got = _ids(llm, params)
        assert got == [[o.token_ids for o in outs] for outs in want]
        assert all(a != b for a, b in got)  # the two children differ: it samples
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0
        _assert_drained(llm)
    finally:
        llm.shutdown()


def test_n_stop_strings_max_tokens_and_logprobs(tiny_models):
    model = tiny_models["qwen2"]
    base = _plain(model, GREEDY, **ROOMY)
    text = base[1][0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    params = [
        SamplingParams(temperature=0, max_tokens=13, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]),
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, n=3),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
    ]
    want = _plain(model, params, **ROOMY)
    assert want[1][0].finish_reason == "stop" and stop not in want[1][0].text
    llm = _async_spec(model, NGRAM, **ROOMY)
    try:
        # Every draft right: each step emits up to K + 1 tokens, so 13 and 6 end inside a run.
        install(llm, OracleDrafter(_truth(base), K))
        got = _outputs(llm, params)
        _assert_drained(llm)
    finally:
        llm.shutdown()
    for g, w in zip(got, want, strict=True):
        assert [c.token_ids for c in g] == [c.token_ids for c in w]
        assert [(c.text, c.finish_reason) for c in g] == [(c.text, c.finish_reason) for c in w]
    assert [len(c.token_ids) for c in got[2]] == [10, 10, 10]
    for i in (0, 3):
        lp_g, lp_w = got[i][0].logprobs, want[i][0].logprobs
        assert len(lp_g) == len(got[i][0].token_ids)
        for a, b in zip(lp_g, lp_w, strict=True):
            assert a.keys() == b.keys()
            assert all(abs(a[t] - b[t]) < 1e-4 for t in a)


@pytest.mark.parametrize("draft", ["qwen2", "llama"])
def test_draft_model(tiny_models, draft):
    """The target's own weights as the draft (every draft accepted) and another model's (most
    rejected): the drafter catches up on each step's tokens from that step's record. The cache
    is too small for every sequence's lookahead slots: a step whose new last token got no slot
    catches the draft up only to its cache's end (sync and async; it used to index past it)."""
    spec = {"model": str(tiny_models[draft]), "num_speculative_tokens": K}
    want = _plain(tiny_models["qwen2"], GREEDY, **TIGHT)
    sync = LLM(str(tiny_models["qwen2"]), async_scheduling=False, speculative_config=spec, **TIGHT)
    try:
        _ids(sync, GREEDY)
        sync_drafts = sync.engine.scheduler.spec_stats.num_draft_tokens
    finally:
        sync.shutdown()
    llm = _async_spec(tiny_models["qwen2"], spec, **TIGHT)
    try:
        assert _ids(llm, GREEDY) == [[o.token_ids for o in outs] for outs in want]
        stats = llm.engine.scheduler.spec_stats
        assert stats.num_draft_tokens >= 0.8 * sync_drafts > 0
        if draft == "qwen2":
            assert stats.acceptance_rate == 1.0
        _assert_drained(llm)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def qwen3_5_mtp(tmp_path_factory):
    from tests.model_factory import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("mtp") / "qwen3_5", "qwen3_5", mtp_layers=1)


def _staggered(engine, prompts, params) -> list[list[int]]:
    """The prompts' tokens, their requests added one a step: out of phase, so one's step runs
    while another's is in flight (a step's record then outlives the next step)."""
    tokens, arriving = {}, list(enumerate(prompts))
    while arriving or engine.has_unfinished_requests():
        if arriving:
            i, prompt = arriving.pop(0)
            engine.add_request(EngineRequest(str(i), prompt, params))
        for rid, new in engine.step().tokens_by_request().items():
            tokens.setdefault(rid, []).extend(new)
    return [tokens[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("num_blocks", [96, 10])
def test_mtp_head_on_a_hybrid_model(qwen3_5_mtp, num_blocks):
    """The head reads the hidden states of the step it drafts after, kept with that step while
    the next one runs; under a tiny cache preempted sequences start over (the head's catch-up
    too); the hybrid's 1 + k state slots all come back."""
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    kw = dict(dtype="float32", num_gpu_blocks_override=num_blocks, max_num_batched_tokens=16)
    prompts = PROMPTS[:4]
    want = [outs[0].token_ids for outs in _plain(qwen3_5_mtp, GREEDY, prompts, **kw)]
    sync = LLM(str(qwen3_5_mtp), async_scheduling=False, speculative_config=spec, **kw)
    try:
        assert [ids for [ids] in _ids(sync, GREEDY, prompts)] == want
        sync_drafts = sync.engine.scheduler.spec_stats.num_draft_tokens
    finally:
        sync.shutdown()
    llm = _async_spec(qwen3_5_mtp, spec, **kw)
    try:
        assert [ids for [ids] in _ids(llm, GREEDY, prompts)] == want
        # As many drafts as the synchronous loop proposes, give or take the preemptions.
        drafts = llm.engine.scheduler.spec_stats.num_draft_tokens
        assert drafts >= 0.8 * sync_drafts > 0
        assert _staggered(llm.engine, prompts, GREEDY) == want
        assert (llm.engine.scheduler.num_preemptions > 0) == (num_blocks == 10)
        _assert_drained(llm)
    finally:
        llm.shutdown()


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["mtp", "ngram", "draft_model"])
def test_on_a_gpu_with_captured_graphs(tiny_models, qwen3_5_mtp, method):
    """Verify steps replay captured graphs, whose hidden-state buffer the next replay writes
    over: an MTP head drafts from its step's copy. Requests arrive one a step (out of phase).
    The draft model (the target's own weights: every draft accepted) drafts k = 5, so its chain
    of 4 one-token graph replays reuses host staging while the GPU still runs the target's
    next step (launched before the drafts were proposed)."""
    model = tiny_models["qwen2"] if method == "draft_model" else qwen3_5_mtp
    spec = {
        "mtp": {"method": "mtp", "num_speculative_tokens": 2},
        "ngram": NGRAM,
        "draft_model": {"model": str(model), "num_speculative_tokens": 5},
    }[method]
    gpu = dict(dtype="float32", gpu_memory_utilization=0.3)
    want = [outs[0].token_ids for outs in _plain(model, GREEDY, **gpu)]
    llm = _async_spec(model, spec, **gpu)
    try:
        if method == "ngram":
            truth = {tuple(p): ids for p, ids in zip(PROMPTS, want, strict=True)}
            install(llm, OracleDrafter(truth, K, lambda s, p: p == s % (K + 2)))
        assert _staggered(llm.engine, PROMPTS, GREEDY) == want
        assert [ids for [ids] in _ids(llm, GREEDY)] == want
        assert llm.engine.executor.verify_graphs.replays > 0
        stats = llm.engine.scheduler.spec_stats
        assert stats.num_draft_tokens > 0
        if method == "ngram":
            assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
        elif method == "draft_model":
            assert stats.acceptance_rate == 1.0
        _assert_drained(llm)
    finally:
        llm.shutdown()


def _launched(engine):
    """Step once; the request ids of the step left in flight and the outputs' ids."""
    out = engine.step()
    flight = engine._in_flight
    return ([s.request_id for s in flight.batch.seqs] if flight else []), out


def test_alone_it_runs_every_other_step_and_a_new_prompt_runs_in_between(tiny_models):
    llm = _async_spec(tiny_models["qwen2"], NGRAM, **ROOMY)
    engine = llm.engine
    try:
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        # Drafts for every decoding sequence (wrong ones: the schedule is what is looked at).
        junk = list(range(500, 560))
        install(llm, OracleDrafter({tuple(p): junk for p in PROMPTS}, K))
        engine.add_request(EngineRequest("a", PROMPTS[3], params))
        pattern = [_launched(engine)[0] for _ in range(8)]
        # Prompt of 18 tokens: chunks of 16 and 2, then decodes; never two steps in flight.
        assert pattern == [["a"], [], ["a"], [], ["a"], [], ["a"], []]
        engine.add_request(EngineRequest("b", PROMPTS[1], params))
        # "a" is idle now (its step completed): it runs with b's first chunk...
        assert _launched(engine)[0] == ["a", "b"]
        # ... then both sit out: nothing to launch.
        assert _launched(engine)[0] == []
        engine.add_request(EngineRequest("c", PROMPTS[4], params))
        assert _launched(engine)[0] == ["a", "b"]
        # c arrives while a and b are in flight: its prefill runs beside them.
        assert _launched(engine)[0] == ["c"]
        assert _launched(engine)[0] == ["a", "b"]
        assert _launched(engine)[0] == ["c"]
        # Aborted with their verify steps in flight (c's) or just proposed for (a's, b's).
        assert engine._in_flight.batch.seqs[0].num_spec
        engine.abort_requests(["a", "b", "c"])
        assert not engine.has_unfinished_requests()
        assert not engine.step()  # the aborted step completes: nothing more for them
        _assert_drained(llm)
    finally:
        llm.shutdown()


def test_a_sequence_with_a_step_in_flight_is_not_preempted(tiny_models):
    """Two sequences, blocks for one to grow: the one whose verify step is in flight keeps its
    blocks; the other, short of blocks, preempts itself."""
    llm = _async_spec(tiny_models["qwen2"], NGRAM, dtype="float32", num_gpu_blocks_override=5)
    engine = llm.engine
    sched = engine.scheduler
    try:
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        engine.add_request(EngineRequest("old", PROMPTS[3], params))
        for _ in range(3):
            engine.step()
        engine.add_request(EngineRequest("new", [1] * 30, params))
        preempted = []
        while engine.has_unfinished_requests():
            flight = engine._in_flight
            before = sched.num_preemptions
            in_flight = {s.request_id for s in flight.batch.seqs} if flight else set()
            engine.step()
            if sched.num_preemptions > before:
                victims = {s.request_id for s in sched.waiting if s.num_preemptions}
                assert not victims & in_flight
                preempted.append(victims)
        assert preempted
        _assert_drained(llm)
    finally:
        llm.shutdown()

"""Speculative decoding in the engine, against the same engine without it (tiny random models,
fp32, CPU): greedy output identical token for token whatever the drafts (n-gram, a draft model,
drafts wrong at chosen positions), with stops, max_tokens, min_tokens, penalties, logit bias,
logprobs, n > 1, structured outputs, chunked prefill, prefix caching (hashes and KV events only
for accepted tokens' blocks), preemption; the acceptance counters."""

from __future__ import annotations

import pytest

from atom_runtime import LLM, SamplingParams
from atom_runtime.protocol.block_hash import hash_token_blocks
from tests.runtime.spec_decode.oracle import OracleDrafter, install

K = 3
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}  # fmt: skip
PROMPTS = [
    [11, 22, 33, 44, 55, 11, 22, 33, 44, 55, 11, 22],
    list(range(100, 137)),
    [7, 8, 9, 7, 8, 9, 300, 301, 7, 8],
]
COMMON = dict(dtype="float32", num_gpu_blocks_override=160)


@pytest.fixture(scope="module")
def base(tiny_models):
    llm = LLM(str(tiny_models["qwen2"]), **COMMON)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def spec(tiny_models):
    llm = LLM(str(tiny_models["qwen2"]), speculative_config=NGRAM, **COMMON)
    yield llm
    llm.shutdown()


def _gen(llm, params, prompts=PROMPTS):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def _ids(llm, params, prompts=PROMPTS):
    return [o.token_ids for o in _gen(llm, params, prompts)]


def _truth(base, params, prompts=PROMPTS):
    return {tuple(p): ids for p, ids in zip(prompts, _ids(base, params, prompts), strict=True)}


def _with_oracle(spec, truth, wrong=lambda step, pos: False):
    oracle = OracleDrafter(truth, K, wrong)
    saved = spec.engine.executor.drafter
    install(spec, oracle)
    return oracle, saved


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def test_ngram_greedy_output_is_the_plain_engines(base, spec):
    stats = spec.engine.scheduler.spec_stats
    before = stats.num_draft_tokens
    assert _ids(spec, GREEDY) == _ids(base, GREEDY)
    assert stats.num_draft_tokens > before  # the repetitive prompts did get drafts


@pytest.mark.parametrize("pattern", ["none", "first", "rotating", "last"])
def test_rejections_at_any_position_leave_greedy_output_unchanged(base, spec, pattern):
    wrong = {
        "none": lambda step, pos: False,
        "first": lambda step, pos: pos == 0,
        "rotating": lambda step, pos: pos == step % (K + 1),
        "last": lambda step, pos: pos == K - 1,
    }[pattern]
    truth = _truth(base, GREEDY)
    stats = spec.engine.scheduler.spec_stats
    stats.reset()
    _, saved = _with_oracle(spec, truth, wrong)
    try:
        assert _ids(spec, GREEDY) == list(truth.values())
    finally:
        install(spec, saved)
    assert stats.num_drafts > 0
    if pattern == "none":
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    elif pattern == "first":
        assert stats.num_accepted_tokens == 0
    elif pattern == "last":  # every full proposal keeps all but its last draft
        assert stats.accepted_per_pos[K - 1] == 0 and stats.accepted_per_pos[0] > 0


def test_stops_inside_an_accepted_run_end_the_text_there(base, spec):
    truth = _truth(base, GREEDY)
    first = list(truth.values())[1]
    stop = first[5]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop])
    _, saved = _with_oracle(spec, truth)
    try:
        got = _gen(spec, params)
    finally:
        install(spec, saved)
    want = _gen(base, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert got[1].token_ids[-1] == stop and (got[1].finish_reason, got[1].stop_reason) == (
        "stop",
        stop,
    )
    # max_tokens: drafts never run past it, every text exactly that long.
    short = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    _, saved = _with_oracle(spec, truth)
    try:
        assert [len(o.token_ids) for o in _gen(spec, short)] == [5] * len(PROMPTS)
    finally:
        install(spec, saved)


def test_eos_and_min_tokens_decide_per_position(base, spec):
    free = _ids(base, GREEDY)[1]
    params = SamplingParams(temperature=0, max_tokens=24, min_tokens=4, stop_token_ids=[free[1]])
    truth = _truth(base, params)
    _, saved = _with_oracle(spec, _truth(base, GREEDY))  # drafts as if nothing stopped
    try:
        assert _ids(spec, params) == list(truth.values())
    finally:
        install(spec, saved)


def test_penalties_bias_and_logprobs_match_the_plain_engine(base, spec):
    params = SamplingParams(
        temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3,
        presence_penalty=0.4, frequency_penalty=0.2, logit_bias={500: 2.0}, logprobs=2,
    )  # fmt: skip
    want = _gen(base, params)
    truth = {tuple(p): o.token_ids for p, o in zip(PROMPTS, want, strict=True)}
    _, saved = _with_oracle(spec, truth, lambda step, pos: pos == 2)
    try:
        got = _gen(spec, params)
    finally:
        install(spec, saved)
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        for a, b in zip(g.logprobs, w.logprobs, strict=True):
            assert a.keys() == b.keys()
            assert all(abs(a[t] - b[t]) < 1e-4 for t in a)


def test_n_children_speculate_independently(base, spec):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=3)
    want = spec.generate({"prompt_token_ids": PROMPTS[0]}, params, use_tqdm=False)[0]
    plain = base.generate({"prompt_token_ids": PROMPTS[0]}, params, use_tqdm=False)[0]
    assert [c.token_ids for c in want.outputs] == [c.token_ids for c in plain.outputs]
    seeded = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, n=3, seed=5)
    one = spec.generate({"prompt_token_ids": PROMPTS[0]}, seeded, use_tqdm=False)[0]
    two = spec.generate({"prompt_token_ids": PROMPTS[0]}, seeded, use_tqdm=False)[0]
    assert [c.token_ids for c in one.outputs] == [c.token_ids for c in two.outputs]
    assert len({tuple(c.token_ids) for c in one.outputs}) > 1


@pytest.mark.parametrize("pattern", ["right", "first", "rotating"])
def test_a_seeded_sampled_request_emits_the_plain_engines_tokens(base, spec, pattern):
    """A seeded draw depends on the seed and the token's position alone, and a verify row draws
    its token as the plain sampler would (accepting the draft when they agree): sampled output
    with a seed is the plain engine's token for token, whatever the drafts, alone or batched."""
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, ignore_eos=True, seed=7)
    want = _ids(base, params)
    assert want == [_ids(base, params, [p])[0] for p in PROMPTS]  # any batch
    assert want != _ids(base, params.clone(seed=8))  # it does sample
    truth = {tuple(p): ids for p, ids in zip(PROMPTS, want, strict=True)}
    wrong = {
        "right": lambda step, pos: False,
        "first": lambda step, pos: pos == 0,
        "rotating": lambda step, pos: pos == step % K,
    }[pattern]
    stats = spec.engine.scheduler.spec_stats
    stats.reset()
    _, saved = _with_oracle(spec, truth, wrong)
    try:
        assert _ids(spec, params) == want
        assert _ids(spec, params, PROMPTS[1:2])[0] == want[1]
    finally:
        install(spec, saved)
    assert stats.num_draft_tokens > 0
    if pattern == "right":
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    elif pattern == "first":
        assert stats.num_accepted_tokens == 0


def test_structured_outputs_stay_in_their_grammar(base, spec):
    from atom_runtime.sampling_params import StructuredOutputs

    params = SamplingParams(
        temperature=0, max_tokens=20,
        structured_outputs=StructuredOutputs(regex=r"(ab|cd){2,6}x"),
    )  # fmt: skip
    want = _ids(base, params, PROMPTS[:2])
    truth = {tuple(p): ids for p, ids in zip(PROMPTS[:2], want, strict=True)}
    _, saved = _with_oracle(spec, truth, lambda step, pos: pos == 1)
    try:
        assert _ids(spec, params, PROMPTS[:2]) == want
    finally:
        install(spec, saved)
    assert _ids(spec, params, PROMPTS[:2]) == want  # n-gram drafts the grammar half refuses


def test_chunked_prefill_preemption_and_cached_blocks(tiny_models):
    """A step budget of 16 tokens (prompts in chunks), a cache too small for every sequence at
    once (preemption by recompute), prefix caching across two rounds: outputs are the plain
    engine's, and the cached block hashes are exactly those of the accepted tokens' blocks."""
    prompts = [PROMPTS[0] * 3, PROMPTS[1], PROMPTS[2] * 4, [5, 6] * 9]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    small = dict(dtype="float32", num_gpu_blocks_override=8, max_num_batched_tokens=16)
    plain = LLM(str(tiny_models["qwen2"]), **small)
    try:
        want = _ids(plain, params, prompts)
    finally:
        plain.shutdown()
    llm = LLM(str(tiny_models["qwen2"]), speculative_config=NGRAM, **small)
    try:
        truth = {tuple(p): ids for p, ids in zip(prompts, want, strict=True)}
        install(llm, OracleDrafter(truth, K, lambda step, pos: (step + pos) % 3 == 0))
        assert _ids(llm, params, prompts) == want
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_blocks
        bs = llm.engine.block_size
        expected = set()
        for prompt, out in zip(prompts, want, strict=True):
            tokens = prompt + out[:-1]  # the last token is sampled, never run
            expected.update(hash_token_blocks(tokens[: len(tokens) // bs * bs], bs))
        # No cached hash is of a block holding a rejected draft.
        assert (
            llm.engine.cached_block_hashes() and set(llm.engine.cached_block_hashes()) <= expected
        )
        assert _ids(llm, params, prompts) == want  # again, over the cached prefixes
    finally:
        llm.shutdown()


def test_kv_events_only_for_accepted_blocks(tiny_models, base):
    events_config = '{"enable_kv_cache_events": true, "publisher": "null"}'
    llm = LLM(str(tiny_models["qwen2"]), speculative_config=NGRAM, kv_events_config=events_config,
              **COMMON)  # fmt: skip
    stored = []
    publish = llm.engine.publisher.publish
    llm.engine.publisher.publish = lambda batch: (stored.extend(batch), publish(batch))
    try:
        truth = _truth(base, GREEDY)
        install(llm, OracleDrafter(truth, K, lambda step, pos: pos == 1))
        assert _ids(llm, GREEDY) == list(truth.values())
    finally:
        llm.shutdown()
    texts = [list(p) + out for p, out in truth.items()]
    blocks = [e.token_ids for e in stored if type(e).__name__ == "BlockStored"]
    assert blocks
    for tokens in blocks:  # each stored run is a block-aligned slice of a final text
        assert any(
            text[i : i + len(tokens)] == list(tokens)
            for text in texts
            for i in range(0, len(text), llm.engine.block_size)
        )


def test_draft_model_of_the_same_weights_accepts_everything(tiny_models, base):
    llm = LLM(
        str(tiny_models["qwen2"]),
        speculative_config={"model": str(tiny_models["qwen2"]), "num_speculative_tokens": K},
        **COMMON,
    )
    try:
        assert _ids(llm, GREEDY) == _ids(base, GREEDY)
        stats = llm.engine.scheduler.spec_stats
        assert stats.num_draft_tokens > 0 and stats.acceptance_rate == 1.0
        assert stats.acceptance_lengths[K] > 0
    finally:
        llm.shutdown()


def test_a_draft_model_of_other_weights_is_rejected_but_harmless(tiny_models, base):
    llm = LLM(
        str(tiny_models["qwen2"]),
        speculative_config={"model": str(tiny_models["llama"]), "num_speculative_tokens": K},
        **COMMON,
    )
    try:
        assert _ids(llm, GREEDY) == _ids(base, GREEDY)
        assert llm.engine.scheduler.spec_stats.num_draft_tokens > 0
    finally:
        llm.shutdown()

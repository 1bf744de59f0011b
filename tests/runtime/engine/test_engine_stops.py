"""How requests finish in the engine: stop token ids (with the token's id as stop_reason),
min_tokens banning stop tokens until reached, max_tokens, EOS vs ignore_eos, seeded sampling,
and abort freeing everything."""

from __future__ import annotations

import time

import pytest

from atom_runtime import LLM, SamplingParams
from atom_runtime.protocol.engine_core import EngineRequest

PROMPT = {"prompt_token_ids": [11, 22, 33, 44, 55]}


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(str(tiny_models["qwen2"]), dtype="float32", num_gpu_blocks_override=64)


def _greedy(llm, **kw):
    params = SamplingParams(temperature=0, max_tokens=kw.pop("max_tokens", 8), **kw)
    return llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]


def test_stop_token_id_finishes_with_that_id(llm):
    first = _greedy(llm, ignore_eos=True).token_ids[0]
    out = _greedy(llm, stop_token_ids=[first], ignore_eos=True)
    assert out.token_ids == [first]
    assert (out.finish_reason, out.stop_reason) == ("stop", first)


def test_min_tokens_bans_stop_tokens_until_reached(llm):
    free = _greedy(llm, ignore_eos=True, max_tokens=6).token_ids
    out = _greedy(llm, stop_token_ids=[free[0]], min_tokens=3, ignore_eos=True, max_tokens=6)
    assert free[0] not in out.token_ids[:3]
    assert len(out.token_ids) >= 3


def test_max_tokens_finishes_with_length(llm):
    out = _greedy(llm, ignore_eos=True, max_tokens=5)
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_eos_stops_unless_ignored(llm):
    eos = llm.engine.eos_token_ids[0]
    free = _greedy(llm, ignore_eos=True, max_tokens=4).token_ids
    # Make EOS the model's own choice: stop on it as if it were EOS by declaring it EOS.
    llm.engine.eos_token_ids.append(free[1])
    try:
        out = _greedy(llm, max_tokens=4)
        first_hit = free.index(free[1])  # greedy text may repeat a token
        assert out.token_ids == free[: first_hit + 1] and out.finish_reason == "stop"
        assert out.stop_reason is None  # EOS is not a user stop token
        assert _greedy(llm, ignore_eos=True, max_tokens=4).token_ids == free
    finally:
        llm.engine.eos_token_ids.remove(free[1])
    assert eos in llm.engine.eos_token_ids


def test_seeded_sampling_is_reproducible_and_seed_sensitive(llm):
    def draw(seed):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=8, ignore_eos=True)
        return llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_logit_bias_and_allowed_token_ids_steer_generation(llm):
    free = _greedy(llm, ignore_eos=True).token_ids
    target = next(t for t in range(100, 200) if t not in free)
    assert _greedy(llm, ignore_eos=True, logit_bias={target: 100}).token_ids == [target] * 8
    # A -100 bias on the first greedy token moves the first step elsewhere.
    assert _greedy(llm, ignore_eos=True, logit_bias={free[0]: -100}).token_ids[0] != free[0]
    allowed = [target, target + 1, free[3]]
    out = _greedy(llm, ignore_eos=True, allowed_token_ids=allowed)
    assert set(out.token_ids) <= set(allowed)
    drawn = SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True,
                           allowed_token_ids=allowed)  # fmt: skip
    assert set(llm.generate(PROMPT, drawn, use_tqdm=False)[0].outputs[0].token_ids) <= set(allowed)
    # In one batch, each request keeps its own edits and the plain one is unchanged.
    batch = llm.generate(
        [PROMPT] * 3,
        [
            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias={target: 100}),
            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, allowed_token_ids=allowed),
        ],
        use_tqdm=False,
    )
    assert [b.outputs[0].token_ids for b in batch] == [[target] * 8, free, out.token_ids]


@pytest.mark.parametrize("budget", [None, 7])  # 7: the prompt runs in chunks
def test_prompt_logprobs_match_transformers(tiny_models, budget):
    import torch
    import transformers

    path = str(tiny_models["qwen2"])
    kw = {} if budget is None else {"max_num_batched_tokens": budget}
    llm = LLM(path, dtype="float32", num_gpu_blocks_override=64, **kw)
    prompt = list(range(300, 337))
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3, n=2)
    # Twice: the second run must not take the first's prompt from the prefix cache.
    for _ in range(2):
        (out,) = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        assert all(
            len(e) >= 3 and prompt[i + 1] in e for i, e in enumerate(out.prompt_logprobs[1:])
        )
    llm.shutdown()
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        want = ref(torch.tensor([prompt])).logits[0].log_softmax(-1)
    got = torch.tensor([e[prompt[i + 1]] for i, e in enumerate(out.prompt_logprobs[1:])])
    torch.testing.assert_close(got, want[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0],
                               atol=1e-4, rtol=1e-4)  # fmt: skip
    top = [sorted(e, key=e.get, reverse=True)[:3] for e in out.prompt_logprobs[1:]]
    assert top == want[:-1].topk(3).indices.tolist()


def test_request_metrics_are_filled_and_ordered(llm):
    """RequestOutput.metrics (vLLM's RequestMetrics): arrival, first scheduled, first token,
    last token and finish, in that order, within the call; queue time from the first two."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, n=2)
    before = time.time()
    (out,) = llm.generate(PROMPT, params, use_tqdm=False)
    after = time.time()
    m = out.metrics
    assert before <= m.arrival_time <= m.first_scheduled_time <= m.first_token_time
    assert m.first_token_time <= m.last_token_time <= m.finished_time <= after
    assert m.last_token_time > m.arrival_time  # tokens came, so it moved off the arrival
    assert m.time_in_queue == m.first_scheduled_time - m.arrival_time


def test_abort_frees_every_block(llm):
    engine = llm.engine
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    engine.add_request(EngineRequest("a1", list(range(100, 140)), params))
    engine.add_request(EngineRequest("a2", list(range(200, 210)), params))
    engine.step()
    engine.step()
    outs = engine.abort_requests(["a1", "a2"])
    assert sorted(o.request_id for o in outs) == ["a1", "a2"]
    assert all(o.finish_reason == "abort" for o in outs)
    assert not engine.has_unfinished_requests()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


@pytest.mark.parametrize(
    ("prompt", "kwargs", "field"),
    [
        ([], {}, "prompt"),
        ([10**9], {}, "prompt"),
        ([5, -1], {}, "prompt"),
        ([5, 2**40], {}, "prompt"),  # past int32: the prompt's array conversion overflows
        (list(range(1, 1100)), {}, "prompt"),
        ([1, 2], {"max_tokens": 5000}, "max_tokens"),
        ([1, 2], {"stop_token_ids": [3, 10**6]}, "stop_token_ids"),
        ([1, 2], {"logit_bias": {10**6: 1.0}}, "logit_bias"),
        ([1, 2], {"allowed_token_ids": [5, 10**6]}, "allowed_token_ids"),
    ],
)
def test_bad_requests_raise_naming_the_field_and_queue_nothing(llm, prompt, kwargs, field):
    engine = llm.engine
    params = SamplingParams(**kwargs)
    with pytest.raises(ValueError, match=f"^{field}: "):
        engine.add_request(EngineRequest("bad", prompt, params))
    assert not engine.has_unfinished_requests() and "bad" not in engine.scheduler.requests


def test_warm_up_leaves_no_trace(tiny_models):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fresh = LLM(
        str(tiny_models["llama"]),
        dtype="float32",
        num_gpu_blocks_override=8,
        kv_events_config=f'{{"enable_kv_cache_events": true, "endpoint": "tcp://*:{port}"}}',
    )
    assert fresh.engine.publisher.published_total == 0  # the warm-up published no event
    stats = fresh.engine.stats()
    assert (stats.prompt_tokens, stats.generation_tokens) == (0, 0)
    assert (stats.prefix_queries, stats.prefix_hits, stats.num_preemptions) == (0, 0, 0)
    assert stats.num_running == stats.num_waiting == 0
    assert fresh.engine.pool.num_free_blocks == 8 and not fresh.engine.pool.cached
    assert fresh.engine.scheduler.requests == {}
    fresh.shutdown()

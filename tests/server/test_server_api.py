"""`atom serve` answering the official `openai` client: completions, chat, streaming, n, stop,
seed, logprobs, token-id prompts, cached tokens, concurrency, and the non-/v1 endpoints."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest
from openai import AsyncOpenAI

PROMPT = "The quick brown fox jumps over the lazy dog because"
GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    if m is None:
        raise AssertionError(f"{name} not in /metrics:\n{text}")
    return float(m.group(1))


def scrape(server) -> str:
    r = httpx.get(f"{server.url}/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    return r.text


def tokenize(server, **body) -> list[int]:
    r = httpx.post(f"{server.url}/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


@pytest.fixture(scope="module")
def offline_greedy(tiny_models):
    """Greedy text of PROMPT from the in-process `LLM` on the same model: the reference."""
    from atom_runtime import LLM, SamplingParams

    llm = LLM(str(tiny_models["llama"]), dtype="float32", num_gpu_blocks_override=64)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    llm.shutdown()
    return out[0].outputs[0]


def test_models_lists_the_served_model(client, model_name):
    models = client.models.list().data
    assert [m.id for m in models] == [model_name]
    assert models[0].model_extra["max_model_len"] == 1024


def test_completion_matches_offline_llm_and_is_deterministic(client, model_name, offline_greedy):
    first = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=12, **GREEDY)
    again = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=12, **GREEDY)
    assert first.object == "text_completion"
    assert first.choices[0].text == offline_greedy.text
    assert again.choices[0].text == first.choices[0].text
    assert first.choices[0].finish_reason == "length"
    assert first.usage.completion_tokens == 12
    assert first.usage.total_tokens == first.usage.prompt_tokens + 12


def test_streamed_completion_equals_non_streamed_and_reports_usage(
    client, model_name, offline_greedy, server
):
    chunks = list(
        client.completions.create(
            model=model_name,
            prompt=PROMPT,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    *body, last = chunks
    assert "".join(c.choices[0].text for c in body) == offline_greedy.text
    assert body[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in body)
    assert last.choices == []
    assert last.usage.completion_tokens == 12
    assert last.usage.prompt_tokens == len(tokenize(server, prompt=PROMPT))


def test_chat_completion_and_stream(client, model_name, server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    full = client.chat.completions.create(
        model=model_name, messages=messages, max_completion_tokens=6, **GREEDY
    )
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 6
    assert full.usage.prompt_tokens == len(tokenize(server, messages=messages))
    stream = client.chat.completions.create(
        model=model_name,
        messages=messages,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 6


def test_token_id_prompts_single_and_batched(client, model_name, server):
    ids = tokenize(server, prompt=PROMPT)
    by_text = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=5, **GREEDY)
    by_ids = client.completions.create(model=model_name, prompt=ids, max_tokens=5, **GREEDY)
    assert by_ids.usage.prompt_tokens == len(ids)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = client.completions.create(
        model=model_name, prompt=[ids, ids[:4]], max_tokens=5, **GREEDY
    )
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == by_text.choices[0].text
    assert batch.usage.prompt_tokens == len(ids) + 4
    assert batch.usage.completion_tokens == 10


def test_cached_tokens_reported_on_a_repeated_prefix(client, model_name, server):
    assert httpx.post(f"{server.url}/reset_prefix_cache").json() == {"reset": True}
    assert httpx.get(f"{server.url}/debug/kv_cache").json() == {
        "block_hashes": [],
        "num_blocks": 256,
    }
    prompt = list(range(1000, 1100))  # 100 tokens: 6 full blocks of 16
    first = client.completions.create(model=model_name, prompt=prompt, max_tokens=2, **GREEDY)
    second = client.completions.create(model=model_name, prompt=prompt, max_tokens=2, **GREEDY)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 96
    assert second.choices[0].text == first.choices[0].text
    cached = httpx.get(f"{server.url}/debug/kv_cache").json()["block_hashes"]
    assert len(cached) >= 6 and all(isinstance(h, int) for h in cached)


def test_n_choices_with_seed_are_reproducible(client, model_name):
    def sample():
        return client.completions.create(
            model=model_name,
            prompt=PROMPT,
            max_tokens=8,
            n=3,
            seed=7,
            temperature=1.0,
            extra_body={"ignore_eos": True},
        )

    a, b = sample(), sample()
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1  # children get seed + index
    assert a.usage.completion_tokens == 24


def test_stop_string_truncates_and_is_reported(client, model_name, offline_greedy):
    text = offline_greedy.text
    stop = text[6:9]
    cut = text.index(stop)
    out = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=12, stop=[stop], **GREEDY
    )
    assert out.choices[0].text == text[:cut]
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] == stop
    streamed = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=12, stop=stop, stream=True, **GREEDY
    )
    assert "".join(c.choices[0].text for c in streamed) == text[:cut]


def test_logprobs_completions_and_chat(client, model_name):
    out = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=4, logprobs=2, **GREEDY
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == out.choices[0].text
    for token, token_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 2
        assert token_lp <= 0
        assert max(top.values()) == pytest.approx(token_lp)  # greedy: the best is the sampled
        assert top[token] == pytest.approx(token_lp)
    chat = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=3,
        **GREEDY,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3
    for item in content:
        assert [t.logprob for t in item.top_logprobs] == sorted(
            (t.logprob for t in item.top_logprobs), reverse=True
        )
        assert len(item.top_logprobs) == 3
        assert item.top_logprobs[0].token == item.token
        assert item.bytes == list(item.token.encode())


def test_logit_bias_and_allowed_token_ids(client, model_name, server):
    """OpenAI's logit_bias (string token ids) forces or bans tokens; vLLM's allowed_token_ids
    restricts the draw; both in completions and chat."""
    target = tokenize(server, prompt=" fox")[-1]
    word = httpx.post(f"{server.url}/detokenize", json={"tokens": [target] * 3}).json()["prompt"]
    out = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=3, logit_bias={str(target): 100}, **GREEDY
    )
    assert out.choices[0].text == word
    free = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=1, **GREEDY)
    first = tokenize(server, prompt=PROMPT + free.choices[0].text)[
        len(tokenize(server, prompt=PROMPT)) :
    ]
    banned = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=1, logit_bias={str(first[0]): -100}, **GREEDY
    )
    assert banned.choices[0].text != free.choices[0].text
    allowed = tokenize(server, prompt=" the lazy dog")
    chat = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=6,
        temperature=1.0,
        logprobs=True,
        extra_body={"allowed_token_ids": allowed, "ignore_eos": True},
    )
    texts = {httpx.post(f"{server.url}/detokenize", json={"tokens": [t]}).json()["prompt"]
             for t in allowed}  # fmt: skip
    assert [item.token for item in chat.choices[0].logprobs.content] != []
    assert {item.token for item in chat.choices[0].logprobs.content} <= texts


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}


def test_structured_outputs_every_way_to_ask(client, model_name):
    """OpenAI's response_format (json_schema, json_object) and vLLM's guided_* and
    structured_outputs fields, streamed and not."""
    import json

    import jsonschema

    ask = dict(
        model=model_name,
        messages=[{"role": "user", "content": "Who?"}],
        max_tokens=300,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
        extra_body={"structured_outputs": {"disable_any_whitespace": True}},
    )
    chat = client.chat.completions.create(**ask)
    assert chat.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(chat.choices[0].message.content), PERSON)
    streamed = client.chat.completions.create(**ask, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == chat.choices[0].message.content
    compact = client.completions.create(
        model=model_name,
        prompt=PROMPT,
        max_tokens=100,
        temperature=1.0,
        n=3,
        extra_body={"structured_outputs": {"json": PERSON, "disable_any_whitespace": True}},
    )
    for choice in compact.choices:
        jsonschema.validate(json.loads(choice.text), PERSON)
    regex = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=20, extra_body={"guided_regex": "[A-Z]{2}[0-9]"}
    )
    assert re.fullmatch("[A-Z]{2}[0-9]", regex.choices[0].text)
    choice = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Pick"}],
        max_tokens=10,
        extra_body={"guided_choice": ["red", "green"]},
    )
    assert choice.choices[0].message.content in ("red", "green")
    obj = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Any JSON"}],
        max_tokens=200,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert obj.choices[0].message.content.lstrip().startswith("{")


def test_echo_returns_the_prompt_with_its_logprobs(client, model_name, tiny_models):
    """lm-eval-harness' loglikelihood request: echo + logprobs + max_tokens 1."""
    from atom_runtime import LLM, SamplingParams

    out = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=1, logprobs=1, echo=True, temperature=0
    )
    choice = out.choices[0]
    assert choice.text.startswith(PROMPT) and len(choice.text) > len(PROMPT)
    lp = choice.logprobs
    ids = out.usage.prompt_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == ids + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == sorted(lp.text_offset)
    llm = LLM(str(tiny_models["llama"]), dtype="float32", num_gpu_blocks_override=64)
    (ref,) = llm.generate(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    llm.shutdown()
    want = [e[t] for t, e in zip(ref.prompt_token_ids[1:], ref.prompt_logprobs[1:], strict=True)]
    assert lp.token_logprobs[1:ids] == pytest.approx(want, abs=1e-4)
    plain = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=1, temperature=0)
    assert choice.text == PROMPT + plain.choices[0].text
    # Streamed, n = 2, several tokens: the first chunk of each choice carries the prompt.
    kw = dict(model=model_name, prompt=PROMPT, max_tokens=5, logprobs=2, echo=True, n=2, **GREEDY)
    whole = client.completions.create(**kw)
    texts, tokens, lps, offsets = {}, {}, {}, {}
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.logprobs is not None:
                tokens.setdefault(c.index, []).extend(c.logprobs.tokens)
                lps.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
                offsets.setdefault(c.index, []).extend(c.logprobs.text_offset)
    for c in whole.choices:
        assert texts[c.index] == c.text and c.text.startswith(PROMPT)
        assert tokens[c.index] == c.logprobs.tokens
        assert offsets[c.index] == c.logprobs.text_offset
        assert lps[c.index][0] is None
        assert lps[c.index][1:] == pytest.approx(c.logprobs.token_logprobs[1:], abs=1e-5)


def test_vllm_prompt_logprobs(client, model_name, server):
    ids = tokenize(server, prompt=PROMPT)
    out = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 2}
    )
    entries = out.choices[0].model_extra["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for token, entry in zip(ids[1:], entries[1:], strict=True):
        own = entry[str(token)]
        assert own["logprob"] <= 0 and own["rank"] >= 1
        best = max(entry.values(), key=lambda e: e["logprob"])
        assert best["rank"] == 1 and (own["rank"] == 1) == (own["logprob"] == best["logprob"])
        assert len(entry) in (2, 3)  # the top 2, and the prompt's token when not among them
    chat = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=1,
        extra_body={"prompt_logprobs": 0},
    )
    top = chat.model_extra["prompt_logprobs"]
    assert top[0] is None and all(len(e) == 1 for e in top[1:])


def test_64_concurrent_streams(server, model_name, record_property):
    async def one(client: AsyncOpenAI, i: int) -> tuple[str, int, float]:
        start = time.perf_counter()
        ttft = None
        text = ""
        usage = None
        stream = await client.completions.create(
            model=model_name,
            prompt=f"Request number {i} says",
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text and ttft is None:
                ttft = time.perf_counter() - start
            if chunk.choices:
                text += chunk.choices[0].text
            usage = chunk.usage or usage
        return text, usage.completion_tokens, ttft

    async def main():
        async with AsyncOpenAI(
            base_url=f"{server.url}/v1",
            api_key="unused",
            max_retries=0,
            http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=100), timeout=600),
        ) as client:
            start = time.perf_counter()
            results = await asyncio.gather(*(one(client, i) for i in range(64)))
            return results, time.perf_counter() - start

    results, elapsed = asyncio.run(main())
    assert [n for _, n, _ in results] == [16] * 64
    tokens_per_s = 64 * 16 / elapsed
    ttfts = sorted(t for _, _, t in results)
    record_property("tokens_per_s", round(tokens_per_s, 1))
    record_property("median_ttft_s", round(ttfts[32], 3))
    print(f"64 streams x 16 tokens: {tokens_per_s:.0f} tok/s, median TTFT {ttfts[32]:.3f}s")
    # Concurrency must not change greedy results: request 5 alone gives the same text.
    with httpx.Client() as h:
        alone = h.post(
            f"{server.url}/v1/completions",
            json={"prompt": "Request number 5 says", "max_tokens": 16, **_flat(GREEDY)},
        ).json()
    assert alone["choices"][0]["text"] == results[5][0]


def _flat(kwargs: dict) -> dict:
    return {k: v for k, v in kwargs.items() if k != "extra_body"} | kwargs.get("extra_body", {})


def test_metrics_count_a_request_exactly(server, model_name):
    assert httpx.post(f"{server.url}/reset_prefix_cache").json() == {"reset": True}
    before = scrape(server)
    prompt = list(range(2000, 2023))  # 23 tokens never seen before
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": prompt, "max_tokens": 7, "temperature": 0, "ignore_eos": True},
    )
    assert r.status_code == 200
    after = scrape(server)

    def delta(name: str) -> float:
        return metric(after, name) - metric(before, name)

    assert delta("atom:prompt_tokens_total") == 23
    assert delta("atom:generation_tokens_total") == 7
    assert delta('atom:requests_finished_total{reason="length"}') == 1
    assert delta("atom:e2e_request_latency_seconds_count") == 1
    assert delta("atom:time_to_first_token_seconds_count") == 1
    assert delta("atom:time_per_output_token_seconds_count") == 1
    assert delta("atom:request_queue_time_seconds_count") == 1
    assert delta("atom:prefix_cache_queries_total") == 23
    assert delta("atom:prefix_cache_hits_total") == 0
    assert metric(after, "atom:requests_running") == 0
    assert metric(after, "atom:requests_waiting") == 0
    assert metric(after, "atom:kv_cache_usage_ratio") == 0
    assert 'atom:cache_config_info{block_size="16",num_gpu_blocks="256"} 1.0' in after
    for name in ("atom:preemptions_total", "atom:kv_events_published_total"):
        metric(after, name)
    assert metric(after, "atom:kv_events_dropped_total") == 0


def test_tokenize_detokenize_version_health(server):
    ids = tokenize(server, prompt="Hello world")
    assert ids and all(isinstance(t, int) for t in ids)
    r = httpx.post(f"{server.url}/detokenize", json={"tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": "Hello world"}
    assert httpx.get(f"{server.url}/version").json() == {"version": "0.1.0"}
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_a_stream_of_several_prompts_and_choices_with_logprobs_adds_up_to_the_answer(
    client, model_name
):
    """Chunks built from each request's live state, several prompts merged: per choice, the
    streamed text, logprob tokens and text offsets add up to the non-streamed answer, and every
    choice gets its finish."""
    ask = dict(model=model_name, prompt=[PROMPT, "A second prompt"], n=2, max_tokens=6)
    ask.update(logprobs=2, **GREEDY)
    whole = client.completions.create(**ask)
    text: dict[int, str] = {}
    tokens: dict[int, list[str]] = {}
    offsets: dict[int, list[int]] = {}
    finish: dict[int, str] = {}
    for chunk in client.completions.create(**ask, stream=True):
        for c in chunk.choices:
            text[c.index] = text.get(c.index, "") + c.text
            tokens.setdefault(c.index, []).extend(c.logprobs.tokens)
            offsets.setdefault(c.index, []).extend(c.logprobs.text_offset)
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    assert sorted(text) == [0, 1, 2, 3] and finish == {i: "length" for i in range(4)}
    for c in whole.choices:
        assert text[c.index] == c.text
        assert tokens[c.index] == c.logprobs.tokens
        assert offsets[c.index] == c.logprobs.text_offset

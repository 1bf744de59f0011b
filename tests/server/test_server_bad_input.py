"""Malformed and out-of-range requests: each gets an OpenAI error body naming the field, with the
right status, and the server keeps answering everyone else normally."""

from __future__ import annotations

import threading

import httpx
import pytest

COMPLETION = {"prompt": "Hi", "max_tokens": 4}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
BAD_REQUEST = "invalid_request_error"


def _with(base: dict, **changes) -> dict:
    body = dict(base)
    for k, v in changes.items():
        if v is _DROP:
            body.pop(k)
        else:
            body[k] = v
    return body


_DROP = object()

# (id, path, body (dict, or raw bytes), status, error type, param)
ROWS = [
    ("negative max_tokens", "/v1/completions", _with(COMPLETION, max_tokens=-1), 400, BAD_REQUEST, "max_tokens"),
    ("zero max_tokens", "/v1/completions", _with(COMPLETION, max_tokens=0), 400, BAD_REQUEST, "max_tokens"),
    ("max_tokens beyond context", "/v1/completions", _with(COMPLETION, max_tokens=5000), 400, BAD_REQUEST, "max_tokens"),
    ("max_tokens as string", "/v1/completions", _with(COMPLETION, max_tokens="10"), 400, BAD_REQUEST, "max_tokens"),
    ("max_tokens as float", "/v1/completions", _with(COMPLETION, max_tokens=1.5), 400, BAD_REQUEST, "max_tokens"),
    ("prompt longer than context", "/v1/completions", _with(COMPLETION, prompt=[5] * 1024), 400, BAD_REQUEST, "prompt"),
    ("prompt missing", "/v1/completions", _with(COMPLETION, prompt=_DROP), 400, BAD_REQUEST, "prompt"),
    ("prompt of wrong type", "/v1/completions", _with(COMPLETION, prompt=5), 400, BAD_REQUEST, "prompt"),
    ("prompt empty list", "/v1/completions", _with(COMPLETION, prompt=[]), 400, BAD_REQUEST, "prompt"),
    ("prompt empty string", "/v1/completions", _with(COMPLETION, prompt=""), 400, BAD_REQUEST, "prompt"),
    ("token id outside vocab", "/v1/completions", _with(COMPLETION, prompt=[1, 99_999_999]), 400, BAD_REQUEST, "prompt"),
    ("negative temperature", "/v1/completions", _with(COMPLETION, temperature=-0.5), 400, BAD_REQUEST, "temperature"),
    ("temperature as string", "/v1/completions", _with(COMPLETION, temperature="hot"), 400, BAD_REQUEST, "temperature"),
    ("top_p zero", "/v1/completions", _with(COMPLETION, top_p=0), 400, BAD_REQUEST, "top_p"),
    ("top_p above one", "/v1/completions", _with(COMPLETION, top_p=1.5), 400, BAD_REQUEST, "top_p"),
    ("n zero", "/v1/completions", _with(COMPLETION, n=0), 400, BAD_REQUEST, "n"),
    ("n as string", "/v1/completions", _with(COMPLETION, n="2"), 400, BAD_REQUEST, "n"),
    ("n above 128", "/v1/completions", _with(COMPLETION, n=129), 400, BAD_REQUEST, "n"),
    ("n of 2**40 (no fan-out attempted)", "/v1/completions", _with(COMPLETION, n=2**40), 400, BAD_REQUEST, "n"),
    ("seed past 64 bits", "/v1/completions", _with(COMPLETION, seed=2**64, temperature=1.0), 400, BAD_REQUEST, "seed"),
    ("max_tokens past 64 bits", "/v1/completions", _with(COMPLETION, max_tokens=2**70), 400, BAD_REQUEST, "max_tokens"),
    ("top_k past 64 bits", "/v1/completions", _with(COMPLETION, top_k=2**70), 400, BAD_REQUEST, "top_k"),
    ("stop_token_ids past 64 bits", "/v1/completions", _with(COMPLETION, stop_token_ids=[2**70]), 400, BAD_REQUEST, "stop_token_ids"),
    ("logit_bias key past 64 bits", "/v1/completions", _with(COMPLETION, logit_bias={str(2**70): 1}), 400, BAD_REQUEST, "logit_bias"),
    ("prompt token id past 64 bits", "/v1/completions", _with(COMPLETION, prompt=[1, 2**70]), 400, BAD_REQUEST, "prompt"),
    ("empty stop string", "/v1/completions", _with(COMPLETION, stop=[""]), 400, BAD_REQUEST, "stop"),
    ("logprobs too many", "/v1/completions", _with(COMPLETION, logprobs=21), 400, BAD_REQUEST, "logprobs"),
    ("seed as string", "/v1/completions", _with(COMPLETION, seed="x"), 400, BAD_REQUEST, "seed"),
    ("stream_options without stream", "/v1/completions", _with(COMPLETION, stream_options={"include_usage": True}), 400, BAD_REQUEST, "stream_options"),
    ("logit_bias key not a token id", "/v1/completions", _with(COMPLETION, logit_bias={"abc": 1}), 400, BAD_REQUEST, "logit_bias"),
    ("logit_bias above 100", "/v1/completions", _with(COMPLETION, logit_bias={"5": 101}), 400, BAD_REQUEST, "logit_bias"),
    ("logit_bias id outside vocab", "/v1/completions", _with(COMPLETION, logit_bias={"99999999": 1}), 400, BAD_REQUEST, "logit_bias"),
    ("chat logit_bias value of wrong type", "/v1/chat/completions", _with(CHAT, logit_bias={"5": "up"}), 400, BAD_REQUEST, "logit_bias.5"),
    ("allowed_token_ids empty", "/v1/completions", _with(COMPLETION, allowed_token_ids=[]), 400, BAD_REQUEST, "allowed_token_ids"),
    ("allowed_token_ids outside vocab", "/v1/chat/completions", _with(CHAT, allowed_token_ids=[5, 99999999]), 400, BAD_REQUEST, "allowed_token_ids"),
    ("stop_token_ids outside vocab", "/v1/completions", _with(COMPLETION, stop_token_ids=[99999999]), 400, BAD_REQUEST, "stop_token_ids"),
    ("guided_regex that does not compile", "/v1/completions", _with(COMPLETION, guided_regex="[0-9"), 400, BAD_REQUEST, "guided_regex"),
    ("guided_choice with an empty string", "/v1/completions", _with(COMPLETION, guided_choice=["a", ""]), 400, BAD_REQUEST, "guided_choice"),
    ("two structured-output constraints", "/v1/completions", _with(COMPLETION, guided_regex="a", guided_choice=["b"]), 400, BAD_REQUEST, "guided_choice"),
    ("structured_outputs with an unknown key", "/v1/completions", _with(COMPLETION, structured_outputs={"regex": "a", "backend": "x"}), 400, BAD_REQUEST, "structured_outputs"),
    ("structured_outputs grammar undefined rule", "/v1/completions", _with(COMPLETION, structured_outputs={"grammar": "start: nope"}), 400, BAD_REQUEST, "structured_outputs"),
    ("json_schema without its schema", "/v1/chat/completions", _with(CHAT, response_format={"type": "json_schema"}), 400, BAD_REQUEST, "response_format.json_schema"),
    ("json_schema with an invalid schema", "/v1/chat/completions", _with(CHAT, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}), 400, BAD_REQUEST, "response_format"),
    ("response_format of unknown type", "/v1/chat/completions", _with(CHAT, response_format={"type": "xml"}), 400, BAD_REQUEST, "response_format.type"),
    ("structured_outputs options alone", "/v1/completions", _with(COMPLETION, structured_outputs={"disable_any_whitespace": True}), 400, BAD_REQUEST, "structured_outputs"),
    ("kv_transfer_params not an object", "/v1/completions", _with(COMPLETION, kv_transfer_params="x"), 400, BAD_REQUEST, "kv_transfer_params"),
    ("unknown model", "/v1/completions", _with(COMPLETION, model="no-such-model"), 404, BAD_REQUEST, "model"),
    ("invalid JSON", "/v1/completions", b'{"prompt": "Hi",', 400, BAD_REQUEST, None),
    ("body not an object", "/v1/completions", b"[1, 2]", 400, BAD_REQUEST, None),
    ("empty messages", "/v1/chat/completions", _with(CHAT, messages=[]), 400, BAD_REQUEST, "messages"),
    ("messages missing", "/v1/chat/completions", _with(CHAT, messages=_DROP), 400, BAD_REQUEST, "messages"),
    ("messages not a list", "/v1/chat/completions", _with(CHAT, messages="hi"), 400, BAD_REQUEST, "messages"),
    ("unknown role", "/v1/chat/completions", _with(CHAT, messages=[{"role": "wizard", "content": "x"}]), 400, BAD_REQUEST, "messages[0].role"),
    ("content of wrong type", "/v1/chat/completions", _with(CHAT, messages=[{"role": "user", "content": 5}]), 400, BAD_REQUEST, "messages[0].content"),
    ("second message bad", "/v1/chat/completions", _with(CHAT, messages=[{"role": "user", "content": "a"}, {"content": "b"}]), 400, BAD_REQUEST, "messages[1].role"),
    ("chat prompt longer than context", "/v1/chat/completions", _with(CHAT, messages=[{"role": "user", "content": "word " * 1100}]), 400, BAD_REQUEST, "messages"),
    ("max_completion_tokens zero", "/v1/chat/completions", _with(CHAT, max_tokens=_DROP, max_completion_tokens=0), 400, BAD_REQUEST, "max_completion_tokens"),
    ("max_completion_tokens beyond context", "/v1/chat/completions", _with(CHAT, max_tokens=_DROP, max_completion_tokens=5000), 400, BAD_REQUEST, "max_completion_tokens"),
    ("chat max_tokens beyond context", "/v1/chat/completions", _with(CHAT, max_tokens=5000), 400, BAD_REQUEST, "max_tokens"),
    ("top_logprobs too many", "/v1/chat/completions", _with(CHAT, logprobs=True, top_logprobs=30), 400, BAD_REQUEST, "top_logprobs"),
    ("top_logprobs without logprobs", "/v1/chat/completions", _with(CHAT, top_logprobs=2), 400, BAD_REQUEST, "top_logprobs"),
    ("chat negative temperature", "/v1/chat/completions", _with(CHAT, temperature=-1), 400, BAD_REQUEST, "temperature"),
    ("chat n zero", "/v1/chat/completions", _with(CHAT, n=0), 400, BAD_REQUEST, "n"),
    ("named tool with an invalid parameters schema", "/v1/chat/completions", _with(CHAT, tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}], tool_choice={"type": "function", "function": {"name": "f"}}), 400, BAD_REQUEST, "tools"),
    ("tool of unknown type", "/v1/chat/completions", _with(CHAT, tools=[{"type": "retrieval"}]), 400, BAD_REQUEST, "tools[0]"),
    ("tool_choice names no tool", "/v1/chat/completions", _with(CHAT, tools=[{"type": "function", "function": {"name": "f"}}], tool_choice={"type": "function", "function": {"name": "g"}}), 400, BAD_REQUEST, "tool_choice"),
    ("chat unknown model", "/v1/chat/completions", _with(CHAT, model="gpt-4"), 404, BAD_REQUEST, "model"),
    ("chat invalid JSON", "/v1/chat/completions", b"{messages: []}", 400, BAD_REQUEST, None),
    ("tokenize without input", "/tokenize", {}, 400, BAD_REQUEST, "prompt"),
    ("detokenize id outside vocab", "/detokenize", {"tokens": [3, -1]}, 400, BAD_REQUEST, "tokens[1]"),
    # Non-finite floats (JSON has none, but lenient parsers read these spellings).
    ("temperature Infinity", "/v1/completions", b'{"prompt": "Hi", "temperature": Infinity}', 400, BAD_REQUEST, "temperature"),
    ("top_p NaN", "/v1/completions", b'{"prompt": "Hi", "top_p": NaN}', 400, BAD_REQUEST, "top_p"),
    ("presence_penalty -Infinity", "/v1/completions", b'{"prompt": "Hi", "presence_penalty": -Infinity}', 400, BAD_REQUEST, "presence_penalty"),
    ("temperature 1e999 (overflows to inf)", "/v1/completions", b'{"prompt": "Hi", "temperature": 1e999}', 400, BAD_REQUEST, "temperature"),
    ("chat frequency_penalty NaN", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "Hi"}], "frequency_penalty": NaN}', 400, BAD_REQUEST, "frequency_penalty"),
    ("chat logit_bias value Infinity", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "Hi"}], "logit_bias": {"5": Infinity}}', 400, BAD_REQUEST, "logit_bias.5"),
    # One request may start at most --max-sequences-per-request (256) sequences.
    ("n x prompts over the cap", "/v1/completions", _with(COMPLETION, prompt=["a"] * 3, n=100), 400, BAD_REQUEST, "n"),
    ("prompts over the cap", "/v1/completions", _with(COMPLETION, prompt=[[5]] * 257), 400, BAD_REQUEST, "prompt"),
    # A JSON schema may not make the server read files or fetch URLs.
    ("guided_json $ref to a file", "/v1/completions", _with(COMPLETION, guided_json={"$ref": "file:///etc/passwd"}), 400, BAD_REQUEST, "guided_json"),
    ("response_format $ref to a URL", "/v1/chat/completions", _with(CHAT, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "http://169.254.169.254/latest/meta-data"}}}), 400, BAD_REQUEST, "response_format"),
]  # fmt: skip


@pytest.mark.parametrize(
    "path, body, status, kind, param", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS]
)
def test_bad_request_gets_openai_error(server, path, body, status, kind, param):
    if isinstance(body, bytes):
        r = httpx.post(
            f"{server.url}{path}", content=body, headers={"content-type": "application/json"}
        )
    else:
        r = httpx.post(f"{server.url}{path}", json=body)
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == kind
    assert error["param"] == param
    assert isinstance(error["message"], str) and error["message"]
    if param is not None and status == 400:
        assert error["message"].startswith(f"{param}: ")


def test_streaming_bad_request_is_an_error_not_a_stream(server):
    r = httpx.post(
        f"{server.url}/v1/completions", json=_with(COMPLETION, max_tokens=5000, stream=True)
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "max_tokens"


def test_unknown_route_and_wrong_method(server):
    r = httpx.get(f"{server.url}/v1/nothing")
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(f"{server.url}/v1/completions")
    assert r.status_code == 405
    assert r.json()["error"]["type"] == BAD_REQUEST


def test_other_requests_are_unaffected(server):
    """A stream running while every bad request of the table arrives completes normally."""
    result = {}

    def stream():
        chunks = []
        with httpx.stream(
            "POST",
            f"{server.url}/v1/completions",
            json={
                "prompt": "Hello",
                "max_tokens": 48,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            },  # fmt: skip
            timeout=600,  # a deadlock guard
        ) as r:
            result["status"] = r.status_code
            chunks = [line for line in r.iter_lines() if line.startswith("data: ")]
        result["chunks"] = chunks

    t = threading.Thread(target=stream)
    t.start()
    for _, path, body, status, _, _ in ROWS:
        if isinstance(body, dict):
            assert httpx.post(f"{server.url}{path}", json=body).status_code == status
    t.join(600)
    assert result["status"] == 200
    assert result["chunks"][-1] == "data: [DONE]"
    assert '"completion_tokens":48' in result["chunks"][-2]
    assert httpx.get(f"{server.url}/health").status_code == 200
    m = httpx.get(f"{server.url}/metrics").text
    assert "atom:requests_running 0.0" in m
    assert "atom:kv_cache_usage_ratio 0.0" in m


# Request fields both endpoints know, and odd values to put in them.
FUZZ_FIELDS = {
    "/v1/completions": ["prompt", "max_tokens", "temperature", "top_p", "n", "stop", "seed",
                        "logprobs", "echo", "logit_bias", "top_k", "min_p", "min_tokens",
                        "stop_token_ids", "allowed_token_ids", "stream", "stream_options",
                        "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                        "structured_outputs", "response_format", "best_of", "suffix"],
    "/v1/chat/completions": ["messages", "max_completion_tokens", "logprobs", "top_logprobs",
                             "tools", "tool_choice", "temperature", "n", "seed", "logit_bias",
                             "allowed_token_ids", "guided_regex", "structured_outputs",
                             "response_format", "chat_template_kwargs", "stop"],
}  # fmt: skip
ODD = [None, True, 0, -1, 2**63, 2**65, -(2**70), 0.5, 1e308, "", "x" * 40, [], {}]


def _odd(rng, depth=0):
    pick = rng.randrange(len(ODD) + 2)
    if pick < len(ODD) or depth > 1:
        return ODD[pick % len(ODD)]
    if pick == len(ODD):
        return [_odd(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = ["type", "json", "name", "function", "regex", "0", "5", "role", "content"]
    return {rng.choice(keys): _odd(rng, depth + 1) for _ in range(rng.randrange(4))}


def test_random_bodies_never_get_a_500_nor_hurt_the_server(server):
    """300 valid requests with one to three fields set to odd values (huge or negative
    integers, wrong types, nested junk): every answer is a 200 or a 4xx with an OpenAI error
    body, and the server stays healthy and answers normally afterwards."""
    import json
    import random

    rng = random.Random(20261129)
    for _ in range(300):
        path = rng.choice(list(FUZZ_FIELDS))
        body = dict(COMPLETION if path == "/v1/completions" else CHAT, max_tokens=3)
        for _ in range(rng.randrange(1, 4)):
            body[rng.choice(FUZZ_FIELDS[path])] = _odd(rng)
        r = httpx.post(
            f"{server.url}{path}",
            content=json.dumps(body),
            headers={"content-type": "application/json"},
            timeout=600,
        )
        assert r.status_code < 500, (body, r.text)
        if r.status_code >= 400:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}, (body, r.text)
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.post(f"{server.url}/v1/completions", json=COMPLETION).status_code == 200

"""What a client without the key, or with a hostile request, can reach and do: the API key guards
every route that serves the model or reads what it was sent (and only those), debug routes need a
flag, a body over the limit is refused before it is parsed, tokenizing a long prompt does not
stall the event loop, and /v1/models names the model without the server's paths."""

from __future__ import annotations

import json
import select
import socket
import time

import httpx
import psutil
import pytest

from tests.server.conftest import TINY_FLAGS

KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMIT = 1024 * 1024
GUARD_S = 300  # deadlock guard for client reads


@pytest.fixture(scope="module")
def guarded(tiny_models, launch_module_server):
    srv = launch_module_server(
        "--model", str(tiny_models["llama"]), *TINY_FLAGS, "--api-key", KEY,
        "--served-model-name", "tiny", "--enable-debug-endpoints",
        "--max-request-body-bytes", str(LIMIT),
    )  # fmt: skip
    yield srv
    assert srv.stop() == 0, srv.log()


KEYED = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                      "max_tokens": 1}),
    ("POST", "/tokenize", {"prompt": "Hi"}),
    ("POST", "/detokenize", {"tokens": [5, 6]}),
    ("GET", "/debug/kv_cache", None),
    ("POST", "/reset_prefix_cache", None),
]  # fmt: skip
OPEN = ["/health", "/metrics", "/version", "/openapi.json", "/docs"]


@pytest.mark.parametrize(("method", "path", "body"), KEYED, ids=[f"{m} {p}" for m, p, _ in KEYED])
def test_keyed_routes_need_the_key(guarded, method, path, body):
    without = httpx.request(method, f"{guarded.url}{path}", json=body, timeout=GUARD_S)
    wrong = httpx.request(
        method, f"{guarded.url}{path}", json=body, timeout=GUARD_S,
        headers={"Authorization": "Bearer nope"},
    )  # fmt: skip
    assert (without.status_code, wrong.status_code) == (401, 401)
    assert without.json()["error"]["code"] == "invalid_api_key"
    good = httpx.request(method, f"{guarded.url}{path}", json=body, headers=AUTH, timeout=GUARD_S)
    assert good.status_code == 200, good.text


@pytest.mark.parametrize("path", OPEN)
def test_probe_and_scrape_routes_stay_open(guarded, path):
    assert httpx.get(f"{guarded.url}{path}", timeout=GUARD_S).status_code == 200


def test_models_names_the_model_not_its_path(guarded, tiny_models):
    r = httpx.get(f"{guarded.url}/v1/models", headers=AUTH, timeout=GUARD_S)
    (model,) = r.json()["data"]
    assert (model["id"], model["root"]) == ("tiny", "tiny")
    assert str(tiny_models["llama"]) not in r.text


def test_a_body_over_the_limit_is_413_before_it_is_parsed(guarded):
    # Not even JSON: a 400 would mean it was parsed.
    junk = b"x" * (LIMIT + 1)
    r = httpx.post(f"{guarded.url}/v1/completions", content=junk, headers=AUTH, timeout=GUARD_S)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"
    assert f"limit of {LIMIT} bytes" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: the limit is counted as the body streams in
        for _ in range(LIMIT // 65536 + 2):
            yield b"y" * 65536

    r = httpx.post(f"{guarded.url}/tokenize", content=chunks(), headers=AUTH, timeout=GUARD_S)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    # Right at the limit is accepted (and then judged on its content).
    at_limit = json.dumps({"prompt": "z" * (LIMIT - 20)}).encode()
    assert len(at_limit) <= LIMIT
    r = httpx.post(f"{guarded.url}/tokenize", content=at_limit, headers=AUTH, timeout=GUARD_S)
    assert r.status_code == 200, r.text
    assert httpx.get(f"{guarded.url}/health", timeout=GUARD_S).status_code == 200


def test_tokenizing_a_long_prompt_leaves_the_event_loop_free(guarded):
    """While a ~1 MB prompt is being tokenized, /health keeps answering: no pause between two
    answers (or before the /tokenize response) takes half of the whole request's time. With
    tokenization on the event loop, or holding the GIL, one pause would take nearly all of it.
    (A ratio of two durations on the same machine: it does not depend on the machine's speed.)"""
    words = " ".join(f"w{i % 9973}" for i in range(160_000))
    body = json.dumps({"prompt": words}).encode()
    assert len(body) < LIMIT
    head = (
        f"POST /tokenize HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    answers = []
    with socket.create_connection(("127.0.0.1", guarded.port)) as sock, httpx.Client() as h:
        began = time.monotonic()
        sock.sendall(head + body)
        while not select.select([sock], [], [], 0)[0]:
            assert h.get(f"{guarded.url}/health", timeout=GUARD_S).status_code == 200
            answers.append(time.monotonic())
        ended = time.monotonic()
        response = b""
        while b"\r\n\r\n" not in response:
            response += sock.recv(65536)
    assert response.startswith(b"HTTP/1.1 200"), response[:200]
    marks = [began, *answers, ended]
    longest = max(b - a for a, b in zip(marks, marks[1:], strict=False))
    assert len(answers) >= 3 and longest < 0.5 * (ended - began), (len(answers), longest)


def test_a_stream_left_by_half_the_clients_leaves_no_blocks_in_use(guarded):
    """64 concurrent streams, every other one dropped after its first chunk: all KV blocks are
    free once the rest finish."""
    import asyncio

    body = {"prompt": "Count with me:", "max_tokens": 24, "ignore_eos": True, "stream": True}

    async def one(client: httpx.AsyncClient, i: int) -> int:
        chunks = 0
        async with client.stream("POST", f"{guarded.url}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunks += 1
                    if i % 2:
                        return chunks  # leaving the block closes the connection mid-stream
        return chunks

    async def main() -> list[int]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(limits=limits, timeout=GUARD_S, headers=AUTH) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    counts = asyncio.run(main())
    assert all(c >= 1 for c in counts)
    deadline = time.monotonic() + GUARD_S
    while True:
        text = httpx.get(f"{guarded.url}/metrics", timeout=GUARD_S).text
        if "atom:requests_running 0.0" in text and "atom:kv_cache_usage_ratio 0.0" in text:
            break
        assert time.monotonic() < deadline, "KV blocks still in use"
        time.sleep(0.05)


def _rss(pids: list[int]) -> int:
    return sum(psutil.Process(pid).memory_info().rss for pid in pids)


def test_memory_stays_flat_over_many_requests(guarded):
    """After a warm-up, 500 more short requests (streamed and not, every fourth client leaving
    early) grow the API server and engine core together by less than 24 MiB: a per-request leak
    of 50 KB or more would show."""
    from concurrent.futures import ThreadPoolExecutor

    pids = [guarded.proc.pid, guarded.engine_pid()]
    url = f"{guarded.url}/v1/completions"

    def one(i: int) -> None:
        body = {"prompt": f"Request {i} says", "max_tokens": 2, "ignore_eos": True}
        with httpx.Client(headers=AUTH, timeout=GUARD_S) as h:
            if i % 2:
                assert h.post(url, json=body).status_code == 200
                return
            with h.stream("POST", url, json={**body, "stream": True}) as r:
                for line in r.iter_lines():
                    if i % 4 == 0 and line.startswith("data: {"):
                        break  # left early

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(100)))
        before = _rss(pids)
        list(pool.map(one, range(100, 600)))
    grown = _rss(pids) - before
    assert grown < 24 * 1024 * 1024, f"grew {grown / 2**20:.1f} MiB over 500 requests"

"""`atom router` over two real `atom serve` engines (aggregated: decode replicas only): answers
are the engines' own, byte for byte in content; a repeated long prefix goes to the pod holding it
(its KV events say so); a killed engine is ejected and later requests still succeed; with no ready
engine, requests wait in a bounded queue that the operator's scale-from-zero reads."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.router.conftest import launch_engine, launch_router
from tests.server.conftest import free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tiny_models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("router-agg")
    engines, router = [], None
    try:
        for _ in range(2):
            engines.append(launch_engine(tmp, tiny_models["llama"]))
        args = []
        for e in engines:
            args += ["--backend", e.backend_arg]
        # A small load weight: one request in flight must not outweigh a cached long prefix.
        router = launch_router(tmp, *args, "--load-weight", "4")
        router.wait_backends("decode", 2)
        yield engines, router
    finally:
        if router is not None:
            router.stop()
        for e in engines:
            e.server.stop()


def _complete(url: str, model: str, **body) -> dict:
    r = httpx.post(f"{url}/v1/completions", json={"model": model, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _stream_text(url: str, path: str, body: dict) -> str:
    parts = []
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                parts.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(parts)


def test_answers_through_the_router_are_the_engines_answers(cluster, model_name):
    engines, router = cluster
    body = {"prompt": "The router relays", "max_tokens": 8, "temperature": 0}
    direct = _complete(engines[0].url, model_name, **body)
    routed = _complete(router.url, model_name, **body)
    assert routed["choices"][0]["text"] == direct["choices"][0]["text"]
    assert routed["usage"]["completion_tokens"] == 8

    chat = {
        "model": model_name,
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 6,
        "temperature": 0,
    }
    d = httpx.post(f"{engines[1].url}/v1/chat/completions", json=chat, timeout=60).json()
    r = httpx.post(f"{router.url}/v1/chat/completions", json=chat, timeout=60).json()
    assert r["choices"][0]["message"] == d["choices"][0]["message"]
    assert (
        _stream_text(router.url, "/v1/chat/completions", chat)
        == d["choices"][0]["message"]["content"]
    )
    assert (
        _stream_text(router.url, "/v1/completions", {"model": model_name, **body})
        == (direct["choices"][0]["text"])
    )

    models = httpx.get(f"{router.url}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [model_name]


def test_bad_json_is_an_openai_400(cluster):
    _, router = cluster
    r = httpx.post(
        f"{router.url}/v1/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_a_repeated_long_prefix_goes_to_the_pod_that_holds_it(cluster, model_name):
    engines, router = cluster
    prefix = [(i * 7) % 500 + 3 for i in range(320)]  # 20 blocks of 16
    # Earlier tests of this module left blocks on either pod: count what this prompt adds.
    before = {b["url"]: b["cached_blocks"] for b in router.backends()["decode"]}
    first = _complete(router.url, model_name, prompt=prefix + [11], max_tokens=1, temperature=0)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # The router hears of the stored blocks through the holder's KV events.
    deadline = time.monotonic() + 20
    while True:
        held = {
            b["url"]: b["cached_blocks"] - before[b["url"]] for b in router.backends()["decode"]
        }
        if max(held.values()) >= 20:
            break
        assert time.monotonic() < deadline, held
        time.sleep(0.05)
    holder = max(held, key=held.get)
    assert min(held.values()) == 0, held
    matched_before = router.metric("atom:router_prefix_matched_tokens_total")
    hits_before = {e.url: e.metric("atom:prefix_cache_hits_total") for e in engines}
    for tail in range(5):
        out = _complete(
            router.url, model_name, prompt=prefix + [40 + tail, 41], max_tokens=1, temperature=0
        )
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 320
    hits = {e.url: e.metric("atom:prefix_cache_hits_total") - hits_before[e.url] for e in engines}
    assert hits[holder] == 5 * 320
    assert sum(hits.values()) == 5 * 320
    assert router.metric("atom:router_prefix_matched_tokens_total") - matched_before == 5 * 320


def test_a_killed_engine_is_ejected_and_later_requests_succeed(cluster, model_name):
    engines, router = cluster
    victim = engines[1]
    victim.server.proc.kill()
    victim.server.proc.wait()
    for i in range(6):
        out = _complete(router.url, model_name, prompt=f"after the crash {i}", max_tokens=2)
        assert out["usage"]["completion_tokens"] == 2
    state = {b["url"]: b for b in router.backends()["decode"]}
    assert state[victim.url]["healthy"] is False
    assert state[engines[0].url]["healthy"] is True
    assert router.metric("atom:router_ejections_total") >= 1


def test_requests_wait_for_a_backend_that_is_not_up_yet(tiny_models, tmp_path, model_name):
    """Scale from zero: the request waits (gauge 1) and is served once the engine is ready; a
    full queue answers 429 and a timed-out wait 503, both with Retry-After."""
    port = free_port()
    router = launch_router(
        tmp_path,
        "--backend",
        f"http://127.0.0.1:{port}",
        "--kv-events-port",
        "0",
        "--queue-size",
        "1",
        "--queue-timeout",
        "120",
    )
    engine = None
    try:
        result: dict = {}

        def send():
            result["r"] = httpx.post(
                f"{router.url}/v1/completions",
                json={"model": model_name, "prompt": "waited", "max_tokens": 2},
                timeout=180,
            )

        t = threading.Thread(target=send)
        t.start()
        deadline = time.monotonic() + 20
        while router.metric('atom:router_queued_requests{role="decode"}') != 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert router.metric('atom:router_demand_total{role="decode"}') == 1
        full = httpx.post(
            f"{router.url}/v1/completions", json={"model": model_name, "prompt": "x"}, timeout=10
        )
        assert full.status_code == 429
        assert int(full.headers["retry-after"]) >= 1
        assert "no decode backend is ready" in full.json()["error"]["message"]

        engine = launch_engine(tmp_path, tiny_models["llama"], port=port)
        t.join(150)
        assert result["r"].status_code == 200, result["r"].text
        assert result["r"].json()["usage"]["completion_tokens"] == 2
        assert router.metric('atom:router_queued_requests{role="decode"}') == 0
    finally:
        router.stop()
        if engine is not None:
            engine.server.stop()


def test_a_wait_that_times_out_is_a_503(tmp_path, model_name):
    router = launch_router(
        tmp_path,
        "--backend",
        f"http://127.0.0.1:{free_port()}",
        "--kv-events-port",
        "0",
        "--queue-timeout",
        "0.5",
    )
    try:
        r = httpx.post(
            f"{router.url}/v1/chat/completions",
            json={"model": model_name, "messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )
        assert r.status_code == 503
        assert r.headers["retry-after"]
        assert r.json()["error"]["type"] == "service_unavailable"
        assert router.metric('atom:router_queued_requests{role="decode"}') == 0
    finally:
        router.stop()

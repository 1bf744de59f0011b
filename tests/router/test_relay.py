"""`atom router`'s relay against engine look-alikes whose failures come on cue: a pod that fails
before the first byte is ejected and the request answered by the next pod; after the first byte
nothing is retried (the stream ends with an error event); a client that leaves before its answer
began closes the pod's request; the client's key reaches /tokenize; per-backend latency and
retries are in /metrics. The router is a real process; the look-alikes serve real HTTP on
127.0.0.1 from threads of the test."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from atom_runtime.router.relay import MAX_HELD_PREAMBLE, says_more_than_roles
from tests.router.conftest import launch_router
from tests.router.fakes import TOKENS, FakeEngine

pytestmark = pytest.mark.slow


@pytest.fixture
def fakes(tmp_path):
    """fakes(*modes, router_args=...) -> (engines, router); everything stopped afterwards."""
    started: list = []

    def make(*modes: str, key: str | None = None, args: tuple[str, ...] = ()):
        engines = [FakeEngine(mode, key) for mode in modes]
        started.extend(engines)
        backends = [arg for e in engines for arg in ("--backend", e.url)]
        router = launch_router(tmp_path, *backends, "--kv-events-port", "0", *args)
        started.append(router)
        router.wait_backends("decode", len(engines))
        return engines, router

    yield make
    for thing in reversed(started):
        thing.stop()


def _latency_count(router, backend: str) -> float:
    name = f'atom:router_backend_request_seconds_count{{backend="{backend}",role="decode"}}'
    try:
        return router.metric(name)
    except KeyError:  # never observed
        return 0.0


def test_a_pod_failing_before_the_first_byte_is_retried_on_the_next(fakes):
    (bad, good), router = fakes("unavailable", "ok", args=("--policy", "round-robin"))
    answered = 0
    for _ in range(20):  # round-robin puts the failing pod first every other request
        r = httpx.post(f"{router.url}/v1/completions", json={"prompt": "x"}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == f"from {good.port}"
        answered += 1
        if bad.completions >= 2:
            break
        time.sleep(0.4)  # a probe re-admits the ejected pod
    assert bad.completions >= 2
    assert router.metric('atom:router_fallbacks_total{reason="retry"}') == bad.completions
    # Ejected by each failure, so re-admitted by a probe in between.
    assert router.metric('atom:router_ejections_total{role="decode"}') == bad.completions
    # Per-backend latency: one observation per answer relayed, none for the failed attempts.
    assert _latency_count(router, good.url) == answered
    assert _latency_count(router, bad.url) == 0


def test_nothing_is_retried_after_the_first_byte(fakes):
    (cut, good), router = fakes("cut", "ok", args=("--policy", "round-robin"))
    for _ in range(20):
        before = good.completions
        with httpx.stream(
            "POST", f"{router.url}/v1/completions", json={"prompt": "x", "stream": True}
        ) as r:
            assert r.status_code == 200
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        if cut.completions:
            break
        time.sleep(0.4)
    assert cut.completions == 1
    # The cut pod's first event reached the client, then an error event and the end marker;
    # the other pod was not asked again.
    assert json.loads(events[0][6:])["choices"][0]["text"] == f"from {cut.port}"
    assert json.loads(events[1][6:])["error"]["type"] == "service_unavailable"
    assert events[2:] == ["data: [DONE]"]
    assert good.completions == before
    assert router.metric('atom:router_fallbacks_total{reason="retry"}') == 0
    # Ejected by the cut (a probe may have re-admitted it since: count, not state).
    assert router.metric('atom:router_ejections_total{role="decode"}') == 1


def test_a_pod_dying_after_a_chat_streams_role_event_is_retried_on_the_next(fakes):
    """The role event goes out before the prefill: held back, so the pod dying during its
    prefill is still a failure before the first byte, and the client gets one clean answer."""
    (cut, good), router = fakes("cut", "ok", args=("--policy", "round-robin"))
    body = {"messages": [{"role": "user", "content": "x"}], "stream": True}
    for _ in range(20):  # round-robin puts the cut pod first every other request
        with httpx.stream("POST", f"{router.url}/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert [json.loads(e[6:])["choices"][0]["delta"] for e in events[:2]] == [
            {"role": "assistant", "content": ""}, {"content": f"from {good.port}"}]  # fmt: skip
        assert events[2:] == ["data: [DONE]"]
        if cut.completions:
            break
        time.sleep(0.4)
    assert cut.completions == 1
    assert router.metric('atom:router_fallbacks_total{reason="retry"}') == 1


@pytest.mark.parametrize(
    ("start", "more"),
    [(b"", True),
     (b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}\n\n', False),
     (b'data: {"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": null}]}\r\n\r\n'
      b'data: {"choices": [{"index": 1, "delta": {"role": "assistant", "content": ""}}]}\n\n', False),
     (b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}\n\ndata: {"cho', False),
     (b': keep-alive\n\n', False),
     (b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"}}]}\n\n', True),
     (b'data: {"choices": [{"index": 0, "delta": {"tool_calls": []}}]}\n\n', True),
     (b'data: {"choices": [{"index": 0, "text": "Hi"}]}\n\n', True),
     (b'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}\n\n', True),
     (b'data: {"choices": [], "usage": {"prompt_tokens": 3}}\n\n', True),
     (b'data: {"error": {"message": "no"}}\n\n', True),
     (b"data: [DONE]\n\n", True),
     (b"data: " + b"x" * (MAX_HELD_PREAMBLE + 1), True)],
)  # fmt: skip
def test_what_counts_as_more_than_the_opening_role_events(start, more):
    assert says_more_than_roles(start) is more


def test_a_client_leaving_before_its_answer_began_closes_the_pods_request(fakes):
    (held,), router = fakes("hold")
    body = json.dumps({"prompt": "x", "max_tokens": 500}).encode()
    conn = socket.create_connection(("127.0.0.1", router.port))
    conn.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    )
    deadline = time.monotonic() + 30
    while held.completions == 0:
        assert time.monotonic() < deadline, "the request never reached the pod"
        time.sleep(0.02)
    conn.close()
    assert held.disconnected.wait(10), "the pod's request stayed open after the client left"
    deadline = time.monotonic() + 10
    while router.backends()["decode"][0]["in_flight"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert router.metric('atom:router_requests_total{code="499",route="/v1/completions"}') == 1
    assert router.backends()["decode"][0]["healthy"] is True  # a client leaving is no pod fault


def test_the_clients_key_reaches_tokenize(fakes):
    """Engines run with --api-key answer /tokenize only to the client's key: without it the
    router could score nothing (no KV-aware choice, no remote prefill)."""
    engines, router = fakes("ok", "ok", key="k-123")
    r = httpx.post(
        f"{router.url}/v1/completions",
        json={"prompt": "x"},
        headers={"Authorization": "Bearer k-123"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    assert router.metric("atom:router_prompt_tokens_total") == len(TOKENS)

"""`atom router` facing hostile clients (a real router process, engine look-alikes on 127.0.0.1):
its own API key guards every route but /health; a 200 MB body is a 413 with the router's memory
flat; an engine's 4xx never ejects it; JSON of any depth is a 400; a client that leaves early or
trickles its headers or body costs one log line and no more; probes log at DEBUG and a loading
engine draws no replay warnings; client kv_transfer_params never reach an engine and internal
ones never reach a client; the cache-salt header takes effect only behind the key, and scoring
follows the salt."""

from __future__ import annotations

import json
import select
import socket
import time

import httpx
import psutil
import pytest

from atom_runtime.kv_events import BlockStored, EventBatch
from atom_runtime.protocol.block_hash import hash_token_blocks, salt_root
from atom_runtime.router.app import Router
from atom_runtime.router.backends import Backend, BackendAddress
from atom_runtime.router.config import RouterConfig
from tests.router.conftest import launch_router
from tests.router.fakes import FakeEngine
from tests.server.conftest import free_port

pytestmark = pytest.mark.slow

KEY = "router-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
GUARD_S = 60  # deadlock guard


@pytest.fixture
def fakes(tmp_path):
    """fakes(*engines, args=...) -> router in front of the given look-alikes; all stopped."""
    started: list = []

    def make(*engines: FakeEngine, args=(), env=None, ready: bool = True, backends=None):
        started.extend(engines)
        if backends is None:
            backends = [arg for e in engines for arg in ("--backend", e.url)]
        router = launch_router(tmp_path, *backends, "--kv-events-port", "0", *args, env=env)
        started.append(router)
        if "--api-key" in args or "ATOM_ROUTER_API_KEY" in (env or {}):
            router.headers = AUTH
        if ready:
            router.wait_backends("decode", len(engines))
        return router

    yield make
    for thing in reversed(started):
        thing.stop()


def _peak_rss(pid: int) -> int:
    """The process's peak resident set (VmHWM), in bytes."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def _raw(port: int, data: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(data)
    return sock


def _head(sock: socket.socket) -> bytes:
    """The status line and headers the router answers (b"": it closed without answering)."""
    sock.settimeout(GUARD_S)
    out = b""
    try:
        while b"\r\n\r\n" not in out and (chunk := sock.recv(65536)):
            out += chunk
    except ConnectionResetError:
        pass
    return out


def _send_until_answered(sock: socket.socket, chunks) -> bytes:
    """Send chunks while the router reads them; stop at its first answer, and return it."""
    for chunk in chunks:
        readable, writable, _ = select.select([sock], [sock], [], GUARD_S)
        if readable:
            break
        assert writable, "the router neither read nor answered"
        try:
            sock.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            break  # it answered and closed
    return _head(sock)


@pytest.mark.parametrize(
    "path",
    ["/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize",
     "/router/backends", "/metrics", "/docs", "/openapi.json", "/no-such-route"],
)  # fmt: skip
def test_the_routers_key_guards_every_route_but_health(fakes, path):
    router = fakes(FakeEngine("ok"), args=("--api-key", KEY))
    method = "GET" if path in ("/v1/models", "/router/backends", "/metrics", "/docs",
                               "/openapi.json") else "POST"  # fmt: skip
    body = {"prompt": "x", "messages": [{"role": "user", "content": "x"}], "tokens": [1]}
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": KEY}):
        r = httpx.request(method, router.url + path, json=body, headers=headers, timeout=GUARD_S)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.request(method, router.url + path, json=body, headers=AUTH, timeout=GUARD_S)
    assert r.status_code == (404 if path == "/no-such-route" else 200), r.text
    assert httpx.get(f"{router.url}/health", timeout=GUARD_S).status_code == 200


def test_the_key_can_come_from_the_environment(fakes):
    router = fakes(FakeEngine("ok"), env={"ATOM_ROUTER_API_KEY": KEY})
    assert httpx.get(f"{router.url}/metrics", timeout=GUARD_S).status_code == 401
    assert httpx.get(f"{router.url}/metrics", headers=AUTH, timeout=GUARD_S).status_code == 200


def test_a_200_mb_body_is_a_413_with_the_routers_memory_flat(fakes):
    engine = FakeEngine("ok")
    router = fakes(engine)
    process = psutil.Process(router.proc.pid)
    rss0, peak0 = process.memory_info().rss, _peak_rss(router.proc.pid)
    chunk = b"x" * (1 << 20)
    # Content-Length says 200 MB: refused at once, the body never read.
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (200 << 20)
    with _raw(router.port, head) as sock:
        assert _send_until_answered(sock, [chunk] * 200).startswith(b"HTTP/1.1 413")
    # No length, chunked: read up to the limit (8 MiB), then refused.
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    framed = b"%x\r\n" % len(chunk) + chunk + b"\r\n"
    with _raw(router.port, head) as sock:
        assert _send_until_answered(sock, [framed] * 200).startswith(b"HTTP/1.1 413")
    assert engine.completions == 0
    # Flat: neither its resident memory now nor its peak since start grew by the body's size.
    grown = max(process.memory_info().rss - rss0, _peak_rss(router.proc.pid) - peak0)
    assert grown < 48 << 20, f"the router's memory grew {grown >> 20} MiB"
    assert httpx.get(f"{router.url}/health", timeout=GUARD_S).status_code == 200


@pytest.mark.parametrize("drains", [True, False], ids=["drains", "cuts-off"])
def test_a_4xx_from_an_engine_never_ejects_it(fakes, drains):
    """An engine with a smaller body limit than the router's refuses 4 MiB bodies. `atom serve`
    reads and drops them after its 413, which reaches the client; a server that cuts the
    connection off instead loses its answer to a reset, and the pod, which still answers its
    probe, stays in rotation all the same (it once was ejected each time: 17 requests, 18
    ejections)."""
    engine = FakeEngine("ok", body_limit=1 << 20, drain_limit=(8 << 20) if drains else None)
    router = fakes(engine, args=("--max-request-body-bytes", str(64 << 20)))
    body = json.dumps({"prompt": "y" * (4 << 20)}).encode()
    for _ in range(17):
        r = httpx.post(f"{router.url}/v1/completions", content=body, timeout=GUARD_S)
        assert r.status_code == (413 if drains else 503), r.text
        assert "127.0.0.1" not in r.text  # no pod's address in what the client reads
    assert router.metric('atom:router_ejections_total{role="decode"}') == 0
    assert router.backends()["decode"][0]["healthy"] is True
    r = httpx.post(f"{router.url}/v1/completions", json={"prompt": "x"}, timeout=GUARD_S)
    assert r.status_code == 200


@pytest.mark.parametrize(
    "raw",
    [b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 5000 + b"1" + b"}" * 5000,
     b'{"prompt": "x",', b"[1, 2]", b"\xff\xfe"],
    ids=["deep-array", "deep-object", "truncated", "not-an-object", "not-utf8"],
)  # fmt: skip
def test_bad_json_of_any_depth_is_a_400(fakes, raw):
    engine = FakeEngine("ok")
    router = fakes(engine)
    r = httpx.post(f"{router.url}/v1/completions", content=raw, timeout=GUARD_S)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert engine.completions == 0 and "Traceback" not in router.log()


def _wait_log(router, text: str) -> str:
    deadline = time.monotonic() + GUARD_S
    while text not in (log := router.log()):
        assert time.monotonic() < deadline, f"{text!r} never logged:\n{log}"
        time.sleep(0.05)
    return log


def test_a_client_leaving_early_costs_one_log_line(fakes):
    engine = FakeEngine("hold")
    router = fakes(engine)
    sock = _raw(router.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                             b"Content-Length: 1000\r\n\r\n{\"prompt\"")  # fmt: skip
    sock.close()  # gone before its body
    log = _wait_log(router, "the client left before sending its whole request")
    body = json.dumps({"prompt": "x"}).encode()
    sock = _raw(router.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                             b"Content-Length: %d\r\n\r\n" % len(body) + body)  # fmt: skip
    assert engine.disconnected.wait(0) is False
    deadline = time.monotonic() + GUARD_S
    while engine.completions == 0:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    sock.close()  # gone while its answer is awaited
    log = _wait_log(router, "the client left before its answer began")
    assert "Traceback" not in log and "Exception" not in log
    assert len([line for line in log.splitlines() if "the client left" in line]) == 2


def test_slow_headers_and_slow_bodies_are_cut_off(fakes):
    engine = FakeEngine("ok")
    router = fakes(
        engine, args=("--request-header-timeout", "0.5", "--request-body-timeout", "0.5")
    )
    # Slowloris: a request line and one header, then nothing: closed, nothing answered.
    with _raw(router.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n") as sock:
        assert _head(sock) == b""
    # Headers complete, the body never finished: 408.
    sock = _raw(router.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                             b"Content-Length: 100\r\n\r\n{\"prompt\"")  # fmt: skip
    answer = _head(sock)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert engine.completions == 0
    # An ordinary client is unaffected, keep-alive included.
    with httpx.Client(timeout=GUARD_S) as client:
        for _ in range(3):
            assert client.post(f"{router.url}/v1/completions", json={"prompt": "x"}).is_success


def test_probes_log_at_debug_and_a_loading_engine_draws_no_replay_warning(fakes):
    engine = FakeEngine("ok")
    engine.loading.set()  # /health 503: the engine is still loading its model
    dead_events, dead_replay = free_port(), free_port()  # its KV-event sockets do not exist yet
    backend = f"{engine.url},kv-events={dead_events},kv-replay={dead_replay}"
    router = fakes(engine, backends=("--backend", backend), ready=False)
    deadline = time.monotonic() + GUARD_S
    while engine.health_probes < 15:  # several seconds of probing at 0.3 s
        assert time.monotonic() < deadline
        time.sleep(0.05)
    log = router.log()
    assert "replay" not in log and "HTTP Request" not in log and "probing" not in log, log


def test_client_transfer_params_never_reach_an_engine_nor_internal_ones_a_client(fakes):
    engine = FakeEngine("ok")
    engine.answer_extra = {
        "kv_transfer_params": {"remote_host": "10.9.9.9", "remote_request_id": "t"}
    }
    router = fakes(engine)
    params = {"do_remote_decode": True, "remote_host": "10.6.6.6", "remote_port": 1}
    r = httpx.post(
        f"{router.url}/v1/completions",
        json={"prompt": "x", "kv_transfer_params": params},
        timeout=GUARD_S,
    )
    assert r.status_code == 200 and "kv_transfer_params" not in r.json()
    assert "10.9.9.9" not in r.text
    assert "kv_transfer_params" not in engine.bodies[-1]


def test_the_cache_salt_header_needs_the_routers_key(fakes):
    keyed_engine, open_engine = FakeEngine("ok"), FakeEngine("ok")
    keyed = fakes(keyed_engine, args=("--api-key", KEY))
    unkeyed = fakes(open_engine)
    salt = {"x-atom-cache-salt": "tenant-a"}
    url = "/v1/completions"
    assert httpx.post(keyed.url + url, json={"prompt": "x"}, headers={**AUTH, **salt}).is_success
    assert keyed_engine.bodies[-1]["cache_salt"] == "tenant-a"
    body = {"prompt": "x", "cache_salt": "user-1"}
    assert httpx.post(keyed.url + url, json=body, headers={**AUTH, **salt}).is_success
    assert keyed_engine.bodies[-1]["cache_salt"] == "tenant-a\nuser-1"  # tenant first, always
    assert httpx.post(unkeyed.url + url, json={"prompt": "x"}, headers=salt).is_success
    assert "cache_salt" not in open_engine.bodies[-1]  # no key, no say
    r = httpx.post(unkeyed.url + url, json={"prompt": "x", "cache_salt": 5})
    assert r.status_code == 400 and "cache_salt" in r.json()["error"]["message"]


def test_scoring_follows_the_cache_salt():
    """A pod holding a prompt under one tenant's salt scores as holding nothing for another."""
    router = Router(RouterConfig(backends=["http://a:1"], kv_events_port=None))
    pod = Backend(BackendAddress.parse("http://a:1", None, None), "decode", healthy=True)
    pod.block_size = 4
    tokens = list(range(40, 57))
    salted = hash_token_blocks(tokens, 4, salt_root("tenant-a"))
    router.pool.index.apply(pod.url, EventBatch(0.0, [BlockStored(salted, None, [], 4)]))
    assert router.matched_tokens([pod], tokens, "tenant-a") == {pod.url: 16}
    assert router.matched_tokens([pod], tokens, "tenant-b") == {pod.url: 0}
    assert router.matched_tokens([pod], tokens) == {pod.url: 0}

"""Faults in the middle of a KV transfer, with real processes on 127.0.0.1: a prefill engine, two
decode engines and `atom router`. The prefill engine advertises 127.0.0.2, where a proxy in this
test forwards its control and payload ports; the proxy can hold a payload stripe after its first
bytes, so the test acts while the transfer is under way: the client leaves (nothing is leaked on
either engine), the pulling decode engine dies (the router ejects it and the other decode engine
answers), the prefill engine dies (the decode engine prefills locally)."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.router.conftest import (
    launch_engine,
    launch_router,
    metric,
    prompt_ids,
    transfer_config,
)
from tests.server.conftest import free_port

pytestmark = pytest.mark.slow

PROXY_HOST = "127.0.0.2"  # the producer's advertised address: every pull goes through the proxy
PULL_TIMEOUT_S = 60  # far above what a test waits for: a fallback seen here came from the fault
PROMPT_TOKENS = 400  # 25 blocks held by the producer
PULLED_BLOCKS = 24  # all but the last, which the decode engine computes: a payload far larger
# than the sockets on the way can buffer
HOLD_AFTER = 8192  # payload bytes the proxy lets through before it holds a stripe


class TransferProxy:
    """TCP forwarding from PROXY_HOST to 127.0.0.1 for each port, on threads. `hold()` makes
    every payload connection opened afterwards stop after HOLD_AFTER bytes towards the consumer
    until `release()`; `held` is set when one has. A side that closes ends both."""

    def __init__(self, control_port: int, payload_port: int) -> None:
        self.held = threading.Event()
        self.delivered: list[int] = []  # bytes each payload connection carried to the consumer
        self._gate = threading.Event()
        self._gate.set()
        self._listeners = []
        for port, payload in ((control_port, False), (payload_port, True)):
            listener = socket.create_server((PROXY_HOST, port))
            self._listeners.append(listener)
            threading.Thread(
                target=self._accept, args=(listener, port, payload), daemon=True
            ).start()

    def hold(self) -> None:
        self.held.clear()
        self._gate.clear()

    def release(self) -> None:
        self._gate.set()

    def close(self) -> None:
        self._gate.set()
        for listener in self._listeners:
            listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
            listener.close()

    def _accept(self, listener: socket.socket, port: int, payload: bool) -> None:
        while True:
            try:
                down, _ = listener.accept()
            except OSError:
                return
            up = socket.socket()
            # A small window, with the producer's small send buffer (socket_buffer_bytes): a held
            # stripe cannot sit complete in kernel buffers, so a producer killed meanwhile never
            # delivers all of it.
            up.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            try:
                up.connect(("127.0.0.1", port))
            except OSError:
                down.close()
                up.close()
                continue
            index = None
            if payload:
                self.delivered.append(0)
                index = len(self.delivered) - 1
            ends = _Ends(down, up, held=payload and not self._gate.is_set())
            threading.Thread(target=self._to_producer, args=(ends,), daemon=True).start()
            threading.Thread(target=self._to_consumer, args=(ends, index), daemon=True).start()

    def _to_producer(self, ends: _Ends) -> None:
        try:
            while data := ends.down.recv(65536):
                ends.up.sendall(data)
        except OSError:
            pass
        finally:
            ends.close()

    def _to_consumer(self, ends: _Ends, index: int | None) -> None:
        sent = 0
        try:
            while True:
                limit = 65536
                if ends.held and not self._gate.is_set():
                    if sent >= HOLD_AFTER:
                        self.held.set()
                        while not self._gate.wait(0.05):
                            if ends.closed.is_set():
                                return
                        continue
                    limit = HOLD_AFTER - sent
                data = ends.up.recv(limit)
                if not data:
                    return
                ends.down.sendall(data)
                sent += len(data)
                if index is not None:
                    self.delivered[index] = sent
        except OSError:
            pass
        finally:
            ends.close()


class _Ends:
    def __init__(self, down: socket.socket, up: socket.socket, held: bool) -> None:
        self.down, self.up, self.held = down, up, held
        self.closed = threading.Event()
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            if self.closed.is_set():
                return
            self.closed.set()
            for sock in (self.down, self.up):
                try:
                    sock.shutdown(socket.SHUT_RDWR)  # wakes the other thread
                except OSError:
                    pass
                sock.close()


@pytest.fixture(scope="module")
def faults(tiny_models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pd-faults")
    model = tiny_models["llama"]
    control, payload = free_port(), free_port()
    proxy = TransferProxy(control, payload)
    procs = []
    try:
        prefill = launch_engine(
            tmp,
            model,
            "--kv-transfer-config",
            transfer_config(
                "kv_producer",
                control,
                advertise_host=PROXY_HOST,
                data_port=payload,
                streams=1,
                socket_buffer_bytes=4096,
            ),
        )
        procs.append(prefill.server)
        decodes = []
        for _ in range(2):
            decodes.append(
                launch_engine(
                    tmp,
                    model,
                    "--kv-transfer-config",
                    transfer_config("kv_consumer", free_port(), pull_timeout_s=PULL_TIMEOUT_S),
                )
            )
            procs.append(decodes[-1].server)
        backends = [arg for d in decodes for arg in ("--backend", d.backend_arg)]
        router = launch_router(
            tmp, *backends, "--prefill-backend", prefill.url, "--remote-prefill-threshold", "16"
        )
        procs.append(router)
        router.wait_backends("decode", 2)
        router.wait_backends("prefill", 1)
        yield proxy, prefill, decodes, router
    finally:
        for p in reversed(procs):
            p.stop()
        proxy.close()


def _block_bytes(model: Path) -> int:
    """KV bytes of one 16-token block of the tiny float32 model (every layer, K and V)."""
    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * 16 * cfg["num_key_value_heads"] * head_dim * 4


def _wait(cond, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _body(model_name: str, seed: int) -> dict:
    return {
        "model": model_name,
        "prompt": prompt_ids(seed, PROMPT_TOKENS),
        "max_tokens": 4,
        "temperature": 0,
    }


@contextlib.contextmanager
def _mid_transfer(proxy, url: str, body: dict) -> Iterator[dict]:
    """POST `body` through the router with the proxy holding the payload stripe; the block runs
    once the stripe is held (the fault goes there), then the stripe is let go. The dict holds
    the router's answer under "response" once the block has ended."""
    out: dict = {}

    def send():
        out["response"] = httpx.post(f"{url}/v1/completions", json=body, timeout=180)

    thread = threading.Thread(target=send)
    proxy.hold()
    try:
        thread.start()
        assert proxy.held.wait(60), "no payload stripe started"
        yield out
    finally:
        proxy.release()
        thread.join(180)


def _puller(decodes):
    _wait(
        lambda: any(d.metric("atom:kv_transfer_pulls_in_flight") == 1 for d in decodes),
        what="a pull in flight",
    )
    return next(d for d in decodes if d.metric("atom:kv_transfer_pulls_in_flight") == 1)


def _engine_counts(engine) -> dict[str, float]:
    names = (
        'atom:requests_finished_total{reason="abort"}',
        "atom:kv_transfer_pulls_total",
        "atom:kv_transfer_fallbacks_total",
        "atom:kv_transfer_holds_released_total",
        "atom:kv_transfer_hold_timeouts_total",
        "atom:prompt_tokens_total",
    )
    return {name: engine.metric(name) for name in names}


def test_a_client_leaving_mid_transfer_leaks_nothing_on_either_engine(faults, model_name):
    proxy, prefill, decodes, router = faults
    before = {e.url: _engine_counts(e) for e in (prefill, *decodes)}
    body = json.dumps(_body(model_name, 41)).encode()
    proxy.hold()
    try:
        conn = socket.create_connection(("127.0.0.1", router.port))
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        )
        assert proxy.held.wait(60), "no payload stripe started"
        puller = _puller(decodes)
        assert prefill.metric("atom:kv_transfer_held_blocks") == PROMPT_TOKENS // 16
        assert puller.metric("atom:kv_cache_usage_ratio") > 0  # blocks allocated for the pull
        conn.close()  # the client leaves while the stripe is under way
        # The decode engine aborts the request, stops the pull and frees every block...
        abort = 'atom:requests_finished_total{reason="abort"}'
        _wait(lambda: puller.metric(abort) == before[puller.url][abort] + 1, what="the abort")
        _wait(lambda: puller.metric("atom:kv_transfer_pulls_in_flight") == 0, what="pull ended")
        _wait(lambda: puller.metric("atom:kv_cache_usage_ratio") == 0, what="decode blocks freed")
        # ...and releases the producer's hold, which the producer frees at once (no timeout).
        _wait(lambda: prefill.metric("atom:kv_transfer_held_blocks") == 0, what="hold freed")
        assert prefill.metric("atom:kv_cache_usage_ratio") == 0
        after = {e.url: _engine_counts(e) for e in (prefill, *decodes)}
        released = "atom:kv_transfer_holds_released_total"
        assert after[prefill.url][released] == before[prefill.url][released] + 1
        timeouts = "atom:kv_transfer_hold_timeouts_total"
        assert after[prefill.url][timeouts] == before[prefill.url][timeouts]
        for d in decodes:  # no local prefill for a client that left; no retry elsewhere
            assert (
                after[d.url]["atom:kv_transfer_fallbacks_total"]
                == (before[d.url]["atom:kv_transfer_fallbacks_total"])
            )
            assert (
                after[d.url]["atom:prompt_tokens_total"]
                == before[d.url]["atom:prompt_tokens_total"]
            )
        assert all(b["in_flight"] == 0 and b["healthy"] for b in router.backends()["decode"])
        assert router.metric('atom:router_requests_total{code="499",route="/v1/completions"}') == 1
    finally:
        proxy.release()


def test_a_decode_engine_killed_mid_transfer_is_ejected_and_the_other_answers(faults, model_name):
    proxy, prefill, decodes, router = faults
    body = _body(model_name, 42)
    ref = httpx.post(f"{prefill.url}/v1/completions", json=body, timeout=120).json()
    retries = router.metric('atom:router_fallbacks_total{reason="retry"}')
    released = prefill.metric("atom:kv_transfer_holds_released_total")
    with _mid_transfer(proxy, router.url, body) as out:
        victim = _puller(decodes)
        survivor = next(d for d in decodes if d is not victim)
        pulls = survivor.metric("atom:kv_transfer_pulls_total")
        fallbacks = survivor.metric("atom:kv_transfer_fallbacks_total")
        victim.server.kill_group()  # API server and engine core, mid-stripe
    r = out["response"]
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == ref["choices"][0]["text"]
    # No byte had gone out: the router retried on the other decode engine, which pulled the same
    # held blocks and released them.
    assert router.metric('atom:router_fallbacks_total{reason="retry"}') == retries + 1
    assert survivor.metric("atom:kv_transfer_pulls_total") == pulls + 1
    assert survivor.metric("atom:kv_transfer_fallbacks_total") == fallbacks
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == PULLED_BLOCKS * 16
    _wait(lambda: prefill.metric("atom:kv_transfer_held_blocks") == 0, what="hold released")
    assert prefill.metric("atom:kv_transfer_holds_released_total") == released + 1
    state = {b["url"]: b for b in router.backends()["decode"]}
    assert state[victim.url]["healthy"] is False
    assert router.metric('atom:router_ejections_total{role="decode"}') >= 1
    for seed in (43, 44):  # later requests succeed, through the surviving pod
        later = httpx.post(
            f"{router.url}/v1/completions", json=_body(model_name, seed), timeout=120
        )
        assert later.status_code == 200, later.text
        assert later.json()["usage"]["completion_tokens"] == 4


def test_a_prefill_engine_killed_mid_transfer_is_answered_by_local_prefill(
    faults, model_name, tiny_models
):
    """Runs last in this module: it kills the prefill engine (after the previous test, one decode
    engine is left)."""
    proxy, prefill, decodes, router = faults
    decode = next(d for d in decodes if d.server.proc.poll() is None)
    body = _body(model_name, 45)
    ref = httpx.post(f"{prefill.url}/v1/completions", json=body, timeout=120).json()
    fallbacks = decode.metric("atom:kv_transfer_fallbacks_total")
    with _mid_transfer(proxy, router.url, body) as out:
        assert _puller([decode]) is decode
        prefill.server.kill_group()  # API server and engine core (which serves the payload)
    r = out["response"]
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == ref["choices"][0]["text"]
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # prefilled here
    assert decode.metric("atom:kv_transfer_fallbacks_total") == fallbacks + 1
    assert decode.metric("atom:kv_transfer_pulls_in_flight") == 0
    _wait(lambda: decode.metric("atom:kv_cache_usage_ratio") == 0, what="decode blocks freed")
    # Mid-transfer: the stripe had started, and the dead producer never sent all of it; the pull
    # failed on the cut connection (PULL_TIMEOUT_S is far longer than this test).
    payload = PULLED_BLOCKS * _block_bytes(tiny_models["llama"])
    assert 0 < proxy.delivered[-1] < payload
    assert "prefilling locally" in decode.server.log()
    assert "payload stripe 0" in decode.server.log()
    # The dead prefill pod is ejected; later requests are prefilled by the decode pod.
    for seed in (46, 47):
        later = httpx.post(
            f"{router.url}/v1/completions", json=_body(model_name, seed), timeout=120
        )
        assert later.status_code == 200, later.text
    assert router.backends()["prefill"][0]["healthy"] is False
    assert metric(router.url, 'atom:router_queued_requests{role="prefill"}') == 0

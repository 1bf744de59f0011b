"""An engine facing a hostile client directly (no router, no --kv-transfer-config): it acts on no
kv_transfer_params, a salted prompt is not reported cached to another tenant (the prefix-cache
side channel), a grammar compiling does not stall another stream, an oversized grammar is refused
naming its field, and request ids come from the OS's generator."""

from __future__ import annotations

import json
import os
import random
import select
import socket
import subprocess
import threading
import time

import httpx
import pytest

from atom_runtime.bench.processes import atom_command
from atom_runtime.sampling_params import MAX_CONSTRAINT_BYTES
from atom_runtime.web import request_io
from tests.server.conftest import TINY_FLAGS

GUARD_S = 300  # deadlock guard for client reads
SECRET = [(i * 53) % 700 + 30 for i in range(49)]  # 3 full blocks and one token


@pytest.fixture(scope="module")
def engine(tiny_models, launch_module_server):
    srv = launch_module_server("--model", str(tiny_models["llama"]), *TINY_FLAGS)
    yield srv
    assert srv.stop() == 0, srv.log()


def _complete(engine, **body) -> httpx.Response:
    body = {"model": None, "max_tokens": 1, "temperature": 0, **body}
    body = {k: v for k, v in body.items() if v is not None}
    return httpx.post(f"{engine.url}/v1/completions", json=body, timeout=GUARD_S)


def _cached(engine, prompt, salt: str | None) -> int:
    r = _complete(engine, prompt=prompt, cache_salt=salt)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_kv_transfer_params_from_a_client_are_refused_naming_the_field(engine, path):
    body = {"max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    if path == "/v1/completions":
        body["prompt"] = [5, 6, 7]
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
    r = httpx.post(f"{engine.url}{path}", json=body, timeout=GUARD_S)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "kv_transfer_params"
    assert "remote_" not in r.text and "kv_transfer_params" not in r.json().get("usage", {})


def test_a_salted_prompt_is_not_reported_cached_to_another_tenant(engine):
    """Alice's prompt, under her cache_salt, is cached; a guesser without her salt (or with
    another) sees nothing cached, so cached_tokens cannot confirm her secret (it once said 48 of
    49 for the right guess, 16 for a wrong one)."""
    assert _cached(engine, SECRET, "alice") == 0
    assert _cached(engine, SECRET, None) == 0  # the same tokens, unsalted: nothing shared
    assert _cached(engine, SECRET, "bob") == 0
    assert _cached(engine, SECRET[:33] + [1] * 16, "carol") == 0  # nor a partial guess
    assert _cached(engine, SECRET, "alice") == 48  # her own hits stay
    assert _cached(engine, SECRET, None) == 48  # (the unsalted copy is the guesser's own)
    r = _complete(engine, prompt=SECRET, cache_salt="")
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("guided_choice", [f"choice {i:06d} " + "x" * 40 for i in range(3000)]),
        ("guided_regex", "a" * (MAX_CONSTRAINT_BYTES + 1)),
        ("response_format", {"type": "json_schema", "json_schema": {"name": "s", "schema": {
            "type": "object", "description": "d" * (MAX_CONSTRAINT_BYTES + 1)}}}),
    ],
)  # fmt: skip
def test_an_oversized_grammar_is_refused_naming_its_field(engine, field, value):
    r = _complete(engine, prompt=[5, 6, 7], **{field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
    assert f"more than the {MAX_CONSTRAINT_BYTES}" in r.json()["error"]["message"]


def test_a_grammar_compiling_does_not_stall_another_stream(engine):
    """One stream runs; a request with thousands of choices (just under the cap) arrives. From
    its arrival to its first token no pause between the stream's tokens takes half of that time:
    compiled on the engine thread (as it once was), the grammar froze every stream for all of it.
    (A ratio of two durations on the same machine.)"""
    stream_at: list[float] = []
    started = threading.Event()
    stop = threading.Event()

    def stream() -> None:
        body = {"prompt": [5, 6, 7], "max_tokens": 900, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{engine.url}/v1/completions", json=body, timeout=GUARD_S) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    stream_at.append(time.monotonic())
                    started.set()
                if stop.is_set():
                    return

    runner = threading.Thread(target=stream)
    runner.start()
    try:
        assert started.wait(GUARD_S)
        choices = [f"option number {i:05d}" for i in range(3500)]  # just under the cap
        body = json.dumps(
            {"prompt": [9, 10], "max_tokens": 3, "guided_choice": choices, "stream": True}
        ).encode()
        head = (
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        with socket.create_connection(("127.0.0.1", engine.port)) as sock:
            began = time.monotonic()
            sock.sendall(head + body)
            answer = b""
            while b"data: {" not in answer:  # its first token
                assert select.select([sock], [], [], GUARD_S)[0]
                answer += sock.recv(65536)
            ended = time.monotonic()
        assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
    finally:
        stop.set()
        runner.join(GUARD_S)
    assert runner.is_alive() is False and stream_at[-1] > ended, "the stream ended too soon"
    marks = [began, *[t for t in stream_at if began < t < ended], ended]
    longest = max(b - a for a, b in zip(marks, marks[1:], strict=False))
    assert len(marks) >= 5 and longest < 0.5 * (ended - began), (len(marks), longest)


def test_request_ids_come_from_the_os_not_from_pythons_generator(monkeypatch):
    """Mersenne Twister ids can be predicted from 156 of them; these are drawn from os.urandom
    (random's generator is not consulted), unique, and as long as uuid4's hex."""

    def refuse(*args, **kwargs):
        raise AssertionError("random_id used Python's random module")

    monkeypatch.setattr(random.Random, "getrandbits", refuse)
    monkeypatch.setattr(random, "getrandbits", refuse)
    ids = [request_io.random_id() for _ in range(2000)]  # several draws from the OS
    assert len(set(ids)) == len(ids)
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)


def test_without_a_transfer_key_serve_and_a_disaggregated_router_do_not_start(tmp_path):
    """One line naming what to set, before anything binds or loads."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATOM_TRANSFER_KEY")}
    transfer = '{"kv_connector": "AtomPortableConnector", "kv_role": "kv_consumer"}'
    for argv in (
        ["serve", "--port", "1", "--kv-transfer-config", transfer],
        ["router", "--backend", "http://127.0.0.1:1", "--prefill-backend", "http://127.0.0.1:2"],
    ):
        out = subprocess.run(
            [*atom_command(), *argv], env=env, capture_output=True, text=True, timeout=GUARD_S
        )
        assert out.returncode == 2, out
        lines = [line for line in out.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "ATOM_TRANSFER_KEY_FILE" in lines[0], out.stderr
    key_file = tmp_path / "transfer-key"
    key_file.write_text("ab" * 10)  # too short
    out = subprocess.run(
        [*atom_command(), "serve", "--port", "1", "--kv-transfer-config", transfer],
        env={**env, "ATOM_TRANSFER_KEY_FILE": str(key_file)},
        capture_output=True,
        text=True,
        timeout=GUARD_S,
    )
    assert out.returncode == 2 and "64 hex digits" in out.stderr and "abab" not in out.stderr

"""`atom serve --async-scheduling` (the GPU default, forced here on CPU): a step's outputs reach
the API one step later, so streamed and full responses, concurrent requests, and a client
disconnect while a step is in flight must all behave exactly as with the synchronous loop."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import pytest

from tests.server.conftest import TINY_FLAGS, wait_for
from tests.server.test_server_lifecycle import GUARD_S, LONG, idle, metrics

PROMPTS = ["The quick brown fox", "Once upon a time", "1, 2, 3,", "Paris is"]


@pytest.fixture(scope="module")
def servers(tiny_models, launch_module_server):
    model = ("--model", str(tiny_models["llama"]), *TINY_FLAGS)
    on = launch_module_server(*model, "--async-scheduling")
    off = launch_module_server(*model, "--no-async-scheduling")
    yield on, off
    for srv in (on, off):
        assert srv.stop() == 0, srv.log()


def _complete(server, prompt: str, stream: bool = False, **extra) -> str:
    body = {"prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True, **extra}
    if not stream:
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=GUARD_S)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    text = []
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=GUARD_S
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(text)


def test_same_text_concurrent_streamed_and_full(servers):
    on, off = servers
    want = [_complete(off, p) for p in PROMPTS]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        full = list(pool.map(lambda p: _complete(on, p), PROMPTS))
        streamed = list(pool.map(lambda p: _complete(on, p, stream=True), PROMPTS))
    assert full == want
    assert streamed == want


def test_disconnect_with_a_step_in_flight(servers):
    on, _ = servers
    before = metrics(on)
    with httpx.stream(
        "POST", f"{on.url}/v1/completions", json={**LONG, "stream": True}, timeout=GUARD_S
    ) as r:
        lines = r.iter_lines()
        seen = 0
        while seen < 3:
            seen += next(lines).startswith("data: {")
    wait_for(lambda: idle(on), what="running=0 and kv usage 0 after the disconnect")
    after = metrics(on)
    assert (
        after['atom:requests_finished_total{reason="abort"}']
        - before['atom:requests_finished_total{reason="abort"}']
        == 1
    )
    time.sleep(0.3)
    assert metrics(on)["atom:generation_tokens_total"] == after["atom:generation_tokens_total"]
    assert _complete(on, PROMPTS[0]) == _complete(servers[1], PROMPTS[0])  # still serving

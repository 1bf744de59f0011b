"""Lifecycle of `atom serve`: client disconnects abort and free blocks, SIGTERM drains and exits 0,
a dead engine core turns /health to 503 and ends the server with a non-zero code (a hung one is
killed after the stall timeout), /v1 needs the
API key when one is set, and startup failures exit non-zero with the reason."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time

import httpx
import openai
import pytest

from tests.server.conftest import TINY_FLAGS, launch

# 40 + 980 tokens: the whole 1024-token context, seconds of decoding on CPU.
LONG = {"prompt": list(range(3000, 3040)), "max_tokens": 980, "temperature": 0,
        "ignore_eos": True}  # fmt: skip


# 16 of them at once: far more than a 1.5 s grace period on any CPU (one alone can finish in it).
MANY = {**LONG, "n": 16}


def metrics(server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics").text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(atom:\S+) (\S+)$", text, re.M)}


ABORTS = 'atom:requests_finished_total{reason="abort"}'


def wait_for(predicate, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def idle(server) -> bool:
    m = metrics(server)
    return m["atom:requests_running"] == 0 and m["atom:kv_cache_usage_ratio"] == 0


def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    before = metrics(server)
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**LONG, "stream": True}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        seen = 0
        while seen < 3:
            seen += next(lines).startswith("data: {")
        during = metrics(server)
        assert during["atom:requests_running"] == 1
        assert during["atom:kv_cache_usage_ratio"] > 0
    # Leaving the block closed the connection mid-stream.
    wait_for(lambda: idle(server), what="running=0 and kv usage 0 after the disconnect")
    after = metrics(server)
    assert after[ABORTS] - before[ABORTS] == 1
    generated = after["atom:generation_tokens_total"] - before["atom:generation_tokens_total"]
    assert generated < 980
    time.sleep(0.3)
    assert metrics(server)["atom:generation_tokens_total"] == after["atom:generation_tokens_total"]


def test_disconnect_while_waiting_for_a_full_response_aborts(server):
    before = metrics(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=LONG, timeout=1.0)
    wait_for(lambda: idle(server), what="running=0 after the client timed out")
    assert metrics(server)[ABORTS] - before[ABORTS] == 1


def _stream_lines(url: str, body: dict, out: dict, key: str, started: threading.Event) -> None:
    lines: list[str] = []
    try:
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    started.set()
    except httpx.HTTPError as e:
        out[key + "_error"] = e
    out[key] = lines


def test_sigterm_drains_in_flight_requests_then_exits_cleanly(tiny_models, tmp_path):
    srv = launch(
        tmp_path,
        "--model",
        str(tiny_models["llama"]),
        *TINY_FLAGS,
        "--shutdown-grace-period",
        "1.5",
    )
    engine = srv.engine_pid()
    url = f"{srv.url}/v1/completions"
    out: dict = {}
    short_started, long_started = threading.Event(), threading.Event()
    short = {"prompt": "Hi", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    threads = [
        threading.Thread(target=_stream_lines, args=(url, MANY, out, "long", long_started)),
        threading.Thread(target=_stream_lines, args=(url, short, out, "short", short_started)),
    ]
    threads[0].start()
    assert long_started.wait(30)
    threads[1].start()
    assert short_started.wait(30)
    start = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    with pytest.raises(httpx.ConnectError):  # no longer accepting
        httpx.get(f"{srv.url}/health")
    assert srv.proc.wait(30) == 0, srv.log()
    assert time.monotonic() - start < 1 + 10
    for t in threads:
        t.join(10)
    assert out["short"][-1] == "data: [DONE]"  # finished within the grace period
    assert '"finish_reason":"length"' in out["short"][-2]
    assert out["long"][-1] != "data: [DONE]"  # cut off when the grace period ran out
    assert len(out["long"]) < 16 * 980
    with pytest.raises(ProcessLookupError):
        os.kill(engine, 0)
    assert "SIGTERM handled" in srv.log()


def _long_stream(srv, model: str, result: dict) -> tuple[threading.Thread, threading.Event]:
    """A thread streaming a 980-token completion with the openai client; `result["stream"]` ends
    as "completed" or the APIError, `result["at"]` when it ended. The event: streaming began."""
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=30)
    started = threading.Event()

    def streaming():
        try:
            for _ in client.completions.create(
                model=model, prompt="Hello", max_tokens=980, stream=True,
                extra_body={"ignore_eos": True},
            ):  # fmt: skip
                started.set()
            result["stream"] = "completed"
        except openai.APIError as e:
            result["stream"] = e
        result["at"] = time.monotonic()

    return threading.Thread(target=streaming), started


def test_engine_core_death_fails_requests_with_503_and_ends_server(tiny_models, tmp_path):
    srv = launch(tmp_path, "--model", str(tiny_models["llama"]), *TINY_FLAGS)
    result: dict = {}
    stream, started = _long_stream(srv, str(tiny_models["llama"]), result)

    def blocking():
        r = httpx.post(f"{srv.url}/v1/completions", json=LONG, timeout=30)
        result["blocking"] = r

    threads = [stream, threading.Thread(target=blocking)]
    for t in threads:
        t.start()
    assert started.wait(30)
    time.sleep(0.2)
    os.kill(srv.engine_pid(), signal.SIGKILL)
    killed = time.monotonic()

    def health_503():
        try:
            r = httpx.get(f"{srv.url}/health", timeout=1)
        except httpx.TransportError:
            return None
        return r if r.status_code == 503 else None

    r = wait_for(health_503, timeout=5, what="/health to answer 503")
    assert r.json()["error"]["type"] == "service_unavailable_error"
    for t in threads:
        t.join(10)
    assert time.monotonic() - killed < 5
    assert isinstance(result["stream"], openai.APIError)
    assert "engine core died" in str(result["stream"])
    assert result["blocking"].status_code == 503
    assert result["blocking"].json()["error"]["type"] == "service_unavailable_error"
    assert srv.proc.wait(15) == 1
    assert "the engine core process died" in srv.log()


def test_hung_engine_core_is_killed_after_the_stall_timeout(tiny_models, tmp_path):
    """A healthy engine core survives idle and busy stretches longer than the stall timeout
    (its heartbeats and step outputs keep it alive); a stopped one (SIGSTOP: alive, silent, as
    a hung GPU kernel leaves it) is killed once the timeout passes, its requests fail with 503
    and the server exits 1, the reason in its log."""
    srv = launch(tmp_path, "--model", str(tiny_models["llama"]), *TINY_FLAGS,
                 "--engine-stall-timeout", "3")  # fmt: skip
    time.sleep(5)  # idle longer than the timeout
    done = httpx.post(f"{srv.url}/v1/completions", json=LONG, timeout=60)
    assert done.status_code == 200, done.text
    assert done.json()["usage"]["completion_tokens"] == 980

    result: dict = {}
    thread, started = _long_stream(srv, str(tiny_models["llama"]), result)
    thread.start()
    assert started.wait(30)
    engine = srv.engine_pid()
    os.kill(engine, signal.SIGSTOP)
    stopped = time.monotonic()
    thread.join(20)
    assert isinstance(result["stream"], openai.APIError), result
    assert "engine core died" in str(result["stream"])
    # Killed once 3 s passed since its last message (sent a moment before the SIGSTOP).
    assert 2.5 <= result["at"] - stopped < 10
    assert srv.proc.wait(15) == 1
    assert re.search(r"the engine core sent nothing for \d+ s \(stall timeout 3 s", srv.log())
    with pytest.raises(ProcessLookupError):
        os.kill(engine, 0)


def test_engine_stall_timeout_is_checked(tmp_path):
    srv = launch(tmp_path, "--engine-stall-timeout", "0.5", wait=False)
    assert srv.proc.wait(30) == 2
    assert "--engine-stall-timeout must be 0 (off) or more than 1 s, got 0.5" in srv.log()


def test_api_key_guards_v1_and_health_is_503_while_loading(tiny_models, tmp_path):
    srv = launch(
        tmp_path,
        "--model",
        str(tiny_models["llama"]),
        *TINY_FLAGS,
        "--api-key",
        "s3cret",
        wait=False,
    )
    try:
        statuses = []

        def healthy():
            try:
                code = httpx.get(f"{srv.url}/health", timeout=1).status_code
            except httpx.TransportError:
                return False
            statuses.append(code)
            return code == 200

        wait_for(healthy, timeout=90, what="/health 200")
        assert statuses[0] == 503 and set(statuses) == {503, 200}
        r = httpx.get(f"{srv.url}/v1/models")
        assert r.status_code == 401
        assert r.json()["error"] == {
            "message": r.json()["error"]["message"],
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
        bad = {"Authorization": "Bearer wrong"}
        assert httpx.get(f"{srv.url}/v1/models", headers=bad).status_code == 401
        assert httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x"}).status_code == 401
        good = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="s3cret", max_retries=0)
        out = good.completions.create(model=str(tiny_models["llama"]), prompt="Hi", max_tokens=2)
        assert out.usage.completion_tokens == 2
        assert httpx.get(f"{srv.url}/metrics").status_code == 200  # not under /v1
    finally:
        assert srv.stop() == 0


def test_startup_failure_exits_nonzero_with_the_reason(tiny_models, tmp_path):
    srv = launch(
        tmp_path, "--model", str(tiny_models["llama"]), *TINY_FLAGS, "--max-model-len", "5000",
        wait=False,
    )  # fmt: skip
    assert srv.proc.wait(60) == 1
    assert "max_model_len: 5000 exceeds the model's context length 1024" in srv.log()


def test_busy_port_exits_2_at_once(server, tmp_path):
    srv = launch(tmp_path, "--model", "/nonexistent", port=server.port, wait=False)
    assert srv.proc.wait(30) == 2
    assert f"cannot listen on 127.0.0.1:{server.port}" in srv.log()


def test_process_titles(server):
    titles = subprocess.run(
        ["ps", "-o", "args=", "-p", f"{server.proc.pid},{server.engine_pid()}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")
    assert [t.strip() for t in titles if t.strip()] == ["ATOM::APIServer", "ATOM::EngineCore"]

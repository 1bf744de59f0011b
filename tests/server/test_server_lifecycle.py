"""Lifecycle of `atom serve`: client disconnects abort and free blocks, SIGTERM drains and exits 0
(and cuts what is still running when the grace period ends, cleanly), a dead engine core turns
/health to 503 and ends the server with a non-zero code (a hung one is killed after the stall
timeout), /v1 needs the API key when one is set, and startup failures exit non-zero with the
reason.

No test here depends on how fast the machine is: each waits for a state (a streamed chunk, a
metric, an exit code), and where a request must still be running at some moment the engine core
is frozen with SIGSTOP rather than given "enough" tokens.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import threading
import time

import httpx
import openai
import pytest

from atom_runtime.config import SERVE_MAX_NUM_BATCHED_TOKENS, EngineConfig
from tests.server.conftest import TINY_FLAGS, wait_for

# 40 + 980 tokens: the whole 1024-token context, seconds of decoding on CPU.
LONG = {"prompt": list(range(3000, 3040)), "max_tokens": 980, "temperature": 0,
        "ignore_eos": True}  # fmt: skip
# Deadlock guard for joins and client reads (not a correctness window).
GUARD_S = 300


def metrics(server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=GUARD_S).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(atom:\S+) (\S+)$", text, re.M)}


ABORTS = 'atom:requests_finished_total{reason="abort"}'


def idle(server) -> bool:
    m = metrics(server)
    return m["atom:requests_running"] == 0 and m["atom:kv_cache_usage_ratio"] == 0


def running(server, n: int) -> bool:
    return metrics(server)["atom:requests_running"] == n


def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    before = metrics(server)
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json={**LONG, "stream": True}, timeout=GUARD_S
    ) as r:
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
    time.sleep(0.3)  # room for a bug to show: an aborted request must not generate on
    assert metrics(server)["atom:generation_tokens_total"] == after["atom:generation_tokens_total"]


def test_disconnect_while_waiting_for_a_full_response_aborts(server):
    """The client hangs up once the engine runs its (non-streamed) request: it is aborted, and
    the log holds no "exception was never retrieved" traceback from the helper tasks."""
    before = metrics(server)
    body = httpx.Request("POST", f"{server.url}/v1/completions", json=LONG)
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    raw = f"{head}Content-Length: {len(body.read())}\r\n\r\n".encode() + body.read()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(raw)
        wait_for(lambda: running(server, 1), what="the request to run")
    wait_for(lambda: idle(server), what="running=0 after the client hung up")
    assert metrics(server)[ABORTS] - before[ABORTS] == 1
    # The helper tasks' outcomes are collected once they finish after the abort.
    time.sleep(0.3)
    assert "never retrieved" not in server.log()
    assert "Traceback" not in server.log()


class Streamer(threading.Thread):
    """Streams one completion with httpx: `lines` the data lines, `started` set at the first."""

    def __init__(self, url: str, body: dict) -> None:
        super().__init__()
        self.url, self.body = url, body
        self.lines: list[str] = []
        self.error: Exception | None = None
        self.started = threading.Event()

    def run(self) -> None:
        try:
            with httpx.stream(
                "POST", self.url, json={**self.body, "stream": True}, timeout=GUARD_S
            ) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.lines.append(line)
                        self.started.set()
        except httpx.HTTPError as e:
            self.error = e
        finally:
            self.started.set()  # a failed request must not leave a waiter hanging


def refused(url: str) -> bool:
    """The server no longer serves url: the connection is refused, or (a shutdown racing the
    accept, seen on a loaded machine) accepted and closed without an answer."""
    try:
        httpx.get(url, timeout=GUARD_S)
    except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
        return True
    return False


def test_sigterm_drains_in_flight_requests_then_exits_cleanly(tiny_models, launch_server):
    srv = launch_server(
        "--model", str(tiny_models["llama"]), *TINY_FLAGS, "--shutdown-grace-period", "600"
    )
    engine = srv.engine_pid()
    stream = Streamer(f"{srv.url}/v1/completions", {**LONG, "max_tokens": 64})
    stream.start()
    assert stream.started.wait(GUARD_S) and stream.error is None
    srv.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: refused(f"{srv.url}/health"), what="the server to stop accepting")
    assert srv.proc.wait(GUARD_S) == 0, srv.log()
    stream.join(GUARD_S)
    # Finished in full, long before the grace period ran out: the server left once it was done.
    assert stream.error is None and stream.lines[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in stream.lines[-2]
    # finish_reason "length" says all 64 tokens came; a slow reader may get two in one chunk.
    assert 2 <= len(stream.lines) <= 64 + 1
    with pytest.raises(ProcessLookupError):
        os.kill(engine, 0)
    log = srv.log()
    assert "SIGTERM handled" in log
    assert "cut off" not in log and "Traceback" not in log


def test_sigterm_cuts_requests_still_running_when_the_grace_period_ends(tiny_models, launch_server):
    """The engine core is frozen so both requests are surely still running when the 1 s grace
    period ends: the stream ends with an OpenAI-style error event and [DONE], the non-streamed
    request gets a 503 with an error body, the log counts them, and no traceback is logged."""
    srv = launch_server(
        "--model", str(tiny_models["llama"]), *TINY_FLAGS, "--shutdown-grace-period", "1"
    )
    engine = srv.engine_pid()
    url = f"{srv.url}/v1/completions"
    stream = Streamer(url, LONG)
    answer: dict = {}
    blocking = threading.Thread(
        target=lambda: answer.setdefault("r", httpx.post(url, json=LONG, timeout=GUARD_S))
    )
    stream.start()
    blocking.start()
    assert stream.started.wait(GUARD_S) and stream.error is None
    wait_for(lambda: running(srv, 2), what="both requests to run")
    os.kill(engine, signal.SIGSTOP)
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(GUARD_S) == 0, srv.log()
    stream.join(GUARD_S)
    blocking.join(GUARD_S)
    assert stream.error is None
    assert stream.lines[-1] == "data: [DONE]"
    error = httpx.Response(200, content=stream.lines[-2][len("data: ") :]).json()["error"]
    assert error["type"] == "service_unavailable_error"
    assert error["code"] == "server_shutting_down"
    assert "1 s shutdown grace period" in error["message"]
    r = answer["r"]
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "server_shutting_down"
    log = srv.log()
    assert "shutdown grace period (1 s) over: 2 request(s) still running were cut off" in log
    assert "Traceback" not in log and "Exception in ASGI application" not in log
    with pytest.raises(ProcessLookupError):
        os.kill(engine, 0)


def _long_stream(srv, model: str, result: dict) -> tuple[threading.Thread, threading.Event]:
    """A thread streaming a 980-token completion with the openai client; `result["stream"]` ends
    as "completed" or the APIError, `result["at"]` when it ended. The event: streaming began."""
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=GUARD_S)
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
        finally:
            result["at"] = time.monotonic()
            started.set()

    return threading.Thread(target=streaming), started


def health_503(srv) -> httpx.Response | None:
    try:
        r = httpx.get(f"{srv.url}/health", timeout=GUARD_S)
    except httpx.TransportError:
        return None
    return r if r.status_code == 503 else None


def test_engine_core_death_fails_requests_with_503_and_ends_server(tiny_models, launch_server):
    # The server stays up (answering 503) until SIGTERM, so the test can look at /health.
    srv = launch_server(
        "--model", str(tiny_models["llama"]), *TINY_FLAGS,
        env={"ATOM_ENGINE_DEATH_EXIT_DELAY_S": "600"},
    )  # fmt: skip
    result: dict = {}
    stream, started = _long_stream(srv, str(tiny_models["llama"]), result)

    def blocking():
        result["blocking"] = httpx.post(f"{srv.url}/v1/completions", json=LONG, timeout=GUARD_S)

    threads = [stream, threading.Thread(target=blocking)]
    for t in threads:
        t.start()
    assert started.wait(GUARD_S)
    wait_for(lambda: running(srv, 2), what="both requests to run")
    os.kill(srv.engine_pid(), signal.SIGKILL)

    r = wait_for(lambda: health_503(srv), what="/health to answer 503")
    assert r.json()["error"]["type"] == "service_unavailable_error"
    for t in threads:
        t.join(GUARD_S)
        assert not t.is_alive()
    assert isinstance(result["stream"], openai.APIError)
    assert "engine core died" in str(result["stream"])
    assert result["blocking"].status_code == 503
    assert result["blocking"].json()["error"]["type"] == "service_unavailable_error"
    assert srv.stop() == 1
    assert "the engine core process died" in srv.log()


def test_engine_core_death_ends_the_server_by_itself(tiny_models, launch_server):
    srv = launch_server("--model", str(tiny_models["llama"]), *TINY_FLAGS)
    os.kill(srv.engine_pid(), signal.SIGKILL)
    assert srv.proc.wait(GUARD_S) == 1
    assert "the engine core process died" in srv.log()


def test_hung_engine_core_is_killed_after_the_stall_timeout(tiny_models, launch_server):
    """A healthy engine core survives idle and busy stretches longer than the stall timeout
    (its heartbeats and step outputs keep it alive); a stopped one (SIGSTOP: alive, silent, as
    a hung GPU kernel leaves it) is killed once the timeout passes, its requests fail with 503
    and the server exits 1, the reason in its log."""
    srv = launch_server("--model", str(tiny_models["llama"]), *TINY_FLAGS,
                        "--engine-stall-timeout", "3")  # fmt: skip
    engine = srv.engine_pid()
    time.sleep(5)  # idle longer than the timeout: heartbeats must keep it alive
    # Busy longer than the timeout: stream until 5 s have passed (or the request is done).
    began = time.monotonic()
    with httpx.stream(
        "POST", f"{srv.url}/v1/completions", json={**LONG, "stream": True}, timeout=GUARD_S
    ) as r:
        for line in r.iter_lines():
            assert not line.startswith('data: {"error"'), line
            if time.monotonic() - began > 5:
                break
    wait_for(lambda: idle(srv), what="the busy request to end")
    done = httpx.post(f"{srv.url}/v1/completions", json={**LONG, "max_tokens": 8}, timeout=GUARD_S)
    assert done.status_code == 200, done.text
    assert os.kill(engine, 0) is None  # still the same engine core

    result: dict = {}
    thread, started = _long_stream(srv, str(tiny_models["llama"]), result)
    thread.start()
    assert started.wait(GUARD_S) and "stream" not in result
    os.kill(engine, signal.SIGSTOP)
    stopped = time.monotonic()
    thread.join(GUARD_S)
    assert isinstance(result["stream"], openai.APIError), result
    assert "engine core died" in str(result["stream"])
    assert result["at"] > stopped
    assert srv.proc.wait(GUARD_S) == 1
    silent = re.search(r"the engine core sent nothing for (\d+) s \(stall timeout 3 s", srv.log())
    assert silent and int(silent.group(1)) >= 3, srv.log()
    with pytest.raises(ProcessLookupError):
        os.kill(engine, 0)


def test_engine_stall_timeout_is_checked(launch_server):
    srv = launch_server("--engine-stall-timeout", "0.5", wait=False)
    assert srv.proc.wait(GUARD_S) == 2
    assert "--engine-stall-timeout must be 0 (off) or more than 1 s, got 0.5" in srv.log()


def test_api_key_guards_v1_and_health_is_503_while_loading(tiny_models, launch_server):
    srv = launch_server(
        "--model", str(tiny_models["llama"]), *TINY_FLAGS, "--api-key", "s3cret", wait=False
    )
    statuses = []

    def healthy():
        try:
            code = httpx.get(f"{srv.url}/health", timeout=GUARD_S).status_code
        except httpx.TransportError:
            return False
        statuses.append(code)
        return code == 200

    wait_for(healthy, timeout=GUARD_S, what="/health 200")
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
    # Without --enable-debug-endpoints the debug and reset routes do not exist, key or not.
    keyed = {"Authorization": "Bearer s3cret"}
    assert httpx.get(f"{srv.url}/debug/kv_cache", headers=keyed).status_code == 404
    assert httpx.post(f"{srv.url}/reset_prefix_cache", headers=keyed).status_code == 404
    assert srv.stop() == 0


def test_startup_check_failure_exits_2_in_one_line(tiny_models, launch_server):
    """A --max-model-len past the model's context is refused from its config.json before any
    process starts: exit 2, one line, no traceback."""
    srv = launch_server(
        "--model", str(tiny_models["llama"]), *TINY_FLAGS, "--max-model-len", "5000", wait=False
    )
    assert srv.proc.wait(GUARD_S) == 2
    assert srv.log().splitlines() == [
        "atom serve: error: max_model_len: 5000 exceeds the model's context length 1024 "
        "(max_position_embeddings); lower --max-model-len"
    ]


def test_engine_startup_failure_exits_1_with_the_reason(tiny_models, launch_server):
    """A failure only the loaded engine finds (the context does not fit the KV cache) ends the
    server with exit 1, the reason in one line last, no traceback."""
    srv = launch_server(
        "--model", str(tiny_models["llama"]), "--dtype", "float32",
        "--num-gpu-blocks-override", "4", "--max-model-len", "1000", wait=False,
    )  # fmt: skip
    assert srv.proc.wait(GUARD_S) == 1
    log = srv.log()
    assert "Traceback" not in log
    last = [line for line in log.splitlines() if "atom_runtime" in line][-1]
    assert "the engine failed to start: max_model_len: 1000 tokens do not fit the KV cache" in last


def test_busy_port_exits_2_at_once(server, launch_server):
    srv = launch_server(port=server.port, wait=False)  # the default model: its checks pass
    assert srv.proc.wait(GUARD_S) == 2
    assert f"cannot listen on 127.0.0.1:{server.port}" in srv.log()


def test_process_titles(server):
    titles = subprocess.run(
        ["ps", "-o", "args=", "-p", f"{server.proc.pid},{server.engine_pid()}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")
    assert [t.strip() for t in titles if t.strip()] == ["ATOM::APIServer", "ATOM::EngineCore"]


def test_serving_takes_its_own_step_budget_unless_given_one(server, tiny_models, launch_server):
    """`atom serve` runs steps of up to SERVE_MAX_NUM_BATCHED_TOKENS (4,096: a shorter
    inter-token latency tail than the offline 8,192) when no budget is given, and the given one
    otherwise; the start-up line says which."""
    assert f"up to {SERVE_MAX_NUM_BATCHED_TOKENS} tokens a step" in server.log()
    srv = launch_server(
        "--model", str(tiny_models["llama"]), *TINY_FLAGS, "--max-num-batched-tokens", "640"
    )
    assert "up to 640 tokens a step" in srv.log()


def test_the_serving_step_budget_leaves_given_budgets_and_prefill_only_instances_alone():
    assert EngineConfig().for_serving().max_num_batched_tokens == SERVE_MAX_NUM_BATCHED_TOKENS
    assert EngineConfig(max_num_batched_tokens=9000).for_serving().max_num_batched_tokens == 9000
    producer = (
        '{"kv_connector": "AtomPortableConnector", "kv_role": "kv_producer", '
        '"kv_connector_extra_config": {"insecure": true}}'
    )
    prefill = EngineConfig(kv_transfer_config=producer).for_serving()
    assert prefill.max_num_batched_tokens is None  # the offline budget: no decodes to delay
    consumer = producer.replace("kv_producer", "kv_consumer")
    decode = EngineConfig(kv_transfer_config=consumer).for_serving()
    assert decode.max_num_batched_tokens == SERVE_MAX_NUM_BATCHED_TOKENS

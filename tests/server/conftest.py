"""Real `atom serve` processes on 127.0.0.1, for tests that talk to them over HTTP.

Every server is started through a fixture, so it is stopped at teardown whether the test passed
or not: `launch_server` (function scope) and `launch_module_server` (module scope) hand out a
`launch(*args)` that starts `.venv/bin/atom serve` on a free port in its own process group and
waits for /health; teardown sends SIGTERM, then SIGKILLs the whole group (API server and
EngineCore) if it has not exited. The module-scoped `server` fixture serves the tiny random Llama
(fast to load) to a whole module.

Timeouts here are deadlock guards sized for a loaded 2-core machine, not correctness windows: a
test waits for a state (a /health answer, a metric, an exit code), never for a clock.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ATOM = Path(sys.executable).parent / "atom"
TINY_FLAGS = ("--dtype", "float32", "--num-gpu-blocks-override", "256")
# Deadlock guards: how long a server may take to load or to stop before the test gives up.
STARTUP_GUARD_S = 300.0
STOP_GUARD_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate: Callable[[], object], timeout: float = 120.0, what: str = "condition"):
    """Poll `predicate` until it returns something truthy (returned); `timeout` is a deadlock
    guard, far above what any state change here needs."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text()

    def engine_pid(self) -> int:
        """The EngineCore child's pid (found by its process title's parent)."""
        out = subprocess.run(
            ["ps", "-o", "pid=,args=", "--ppid", str(self.proc.pid)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for line in out.splitlines():
            pid, _, title = line.strip().partition(" ")
            if title.strip() == "ATOM::EngineCore":
                return int(pid)
        raise RuntimeError(f"no ATOM::EngineCore child of {self.proc.pid}: {out!r}")

    def stop(self, timeout: float = STOP_GUARD_S) -> int:
        """SIGTERM and wait for the exit code; the process group is killed if it hangs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill_group()
        return self.proc.returncode

    def kill_group(self) -> None:
        """SIGKILL everything in the server's process group (it leads its own, see `_start`)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def _start(
    tmp_dir: Path, args: tuple[str, ...], env: dict | None, port: int | None
) -> ServerProcess:
    port = port or free_port()
    log_path = tmp_dir / f"serve-{port}.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [str(ATOM), "serve", "--port", str(port), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,  # its own process group, so teardown can kill all of it
        )
    return ServerProcess(proc, port, log_path)


def wait_healthy(server: ServerProcess, timeout: float = STARTUP_GUARD_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"atom serve exited with {server.proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=10).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"atom serve was not healthy within {timeout}s:\n{server.log()}")


class Launcher:
    """Starts `atom serve` processes and owns them: `close()` stops every one it started."""

    def __init__(self, tmp_dir: Path) -> None:
        self.tmp_dir = tmp_dir
        self.started: list[ServerProcess] = []

    def __call__(
        self, *args: str, wait: bool = True, env: dict | None = None, port: int | None = None
    ) -> ServerProcess:
        server = _start(self.tmp_dir, args, env, port)
        self.started.append(server)
        if wait:
            wait_healthy(server)
        return server

    def close(self) -> None:
        for server in self.started:
            server.stop()
            server.kill_group()  # an EngineCore its API server left behind, if any


@pytest.fixture
def launch_server(tmp_path) -> Iterator[Launcher]:
    launcher = Launcher(tmp_path)
    try:
        yield launcher
    finally:
        launcher.close()


@pytest.fixture(scope="module")
def launch_module_server(tmp_path_factory) -> Iterator[Launcher]:
    launcher = Launcher(tmp_path_factory.mktemp("serve"))
    try:
        yield launcher
    finally:
        launcher.close()


@pytest.fixture(scope="module")
def server(tiny_models, launch_module_server):
    srv = launch_module_server(
        "--model", str(tiny_models["llama"]), *TINY_FLAGS, "--enable-debug-endpoints"
    )
    yield srv
    code = srv.stop()
    assert code == 0, f"atom serve exited with {code}:\n{srv.log()}"


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    with OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600) as c:
        yield c


@pytest.fixture(scope="module")
def model_name(tiny_models) -> str:
    return str(tiny_models["llama"])

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

import random
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from atom_runtime.bench.processes import AtomProcess

TINY_FLAGS = ("--dtype", "float32", "--num-gpu-blocks-override", "256")
# Deadlock guards: how long a server may take to load or to stop before the test gives up.
STARTUP_GUARD_S = 300.0
STOP_GUARD_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_floor() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(n: int) -> int:
    """A port p with p .. p + n - 1 free now, for a tensor-parallel producer (rank r listens on
    kv_port + r). Chosen below the kernel's ephemeral range, so no port the kernel hands out to
    another socket of the run (gloo, UCX, a client) can land in the span between the pick and
    the ranks' binds; a port from `free_port()` could, its neighbours being ephemeral too."""
    rng = random.Random()
    floor = _ephemeral_floor()
    while True:
        base = rng.randrange(20000, floor - n)
        socks = []
        try:
            for p in range(base, base + n):
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()


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


class ServerProcess(AtomProcess):
    """An `atom serve` child process (bench/processes.py) and its EngineCore."""

    def __init__(self, port: int, args: tuple[str, ...], log_path: Path, env: dict | None) -> None:
        super().__init__("serve", port, args, log_path, env)

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
        return super().stop(timeout)


def _start(
    tmp_dir: Path, args: tuple[str, ...], env: dict | None, port: int | None
) -> ServerProcess:
    port = port or free_port()
    return ServerProcess(port, args, tmp_dir / f"serve-{port}.log", env)


def wait_healthy(server: ServerProcess, timeout: float = STARTUP_GUARD_S) -> None:
    server.wait_healthy(timeout)


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

"""Real `atom serve` processes on 127.0.0.1, for tests that talk to them over HTTP.

`launch(...)` starts `.venv/bin/atom serve` as a subprocess on a free port and waits for /health;
the module-scoped `server` fixture serves the tiny random Llama (fast to load) to a whole module.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ATOM = Path(sys.executable).parent / "atom"
TINY_FLAGS = ("--dtype", "float32", "--num-gpu-blocks-override", "256")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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

    def stop(self, timeout: float = 20) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def launch(
    tmp_dir: Path,
    *args: str,
    wait: bool = True,
    env: dict | None = None,
    timeout: float = 90,
    port: int | None = None,
) -> ServerProcess:
    port = port or free_port()
    log_path = tmp_dir / f"serve-{port}.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [str(ATOM), "serve", "--port", str(port), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
    server = ServerProcess(proc, port, log_path)
    if wait:
        wait_healthy(server, timeout)
    return server


def wait_healthy(server: ServerProcess, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"atom serve exited with {server.proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"atom serve was not healthy within {timeout}s:\n{server.log()}")


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    srv = launch(
        tmp_path_factory.mktemp("serve"), "--model", str(tiny_models["llama"]), *TINY_FLAGS
    )
    yield srv
    code = srv.stop()
    assert code == 0, f"atom serve exited with {code}:\n{srv.log()}"


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    with OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def model_name(tiny_models) -> str:
    return str(tiny_models["llama"])

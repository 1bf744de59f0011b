"""Real `atom serve` engines with KV events, and real `atom router` processes, on 127.0.0.1."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from atom_runtime.bench.processes import AtomProcess
from atom_runtime.kv_transfer.auth import TransferKey
from tests.server.conftest import TINY_FLAGS, Launcher, ServerProcess, free_port

# The deployment's KV-transfer key in these tests: given to every engine and router started here;
# a test that plays the router signs with it.
TRANSFER_KEY_HEX = "4b" * 32
TRANSFER_KEY = TransferKey.from_text(TRANSFER_KEY_HEX, "test")
KEY_ENV = {"ATOM_TRANSFER_KEY": TRANSFER_KEY_HEX}


@dataclass
class Engine:
    server: ServerProcess
    kv_port: int
    replay_port: int

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def backend_arg(self) -> str:
        return f"{self.url},kv-events={self.kv_port},kv-replay={self.replay_port}"

    def metric(self, name: str) -> float:
        return metric(self.url, name)


def metric(url: str, name: str, headers: dict | None = None) -> float:
    """One unlabelled (or first labelled) sample of `name` from url/metrics."""
    for line in httpx.get(f"{url}/metrics", timeout=10, headers=headers).text.splitlines():
        if line.startswith(name) and line[len(name)] in " {":
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def launch_engine(tmp: Path, model: Path, *extra: str, port: int | None = None, wait=True):
    kv_port, replay_port = free_port(), free_port()
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{kv_port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
        "topic": f"kv@127.0.0.1:{kv_port}@tiny",
    }
    # The test stops it (ServerProcess.stop also kills what is left of its process group).
    server = Launcher(tmp)(
        "--model",
        str(model),
        *TINY_FLAGS,
        "--max-model-len",
        "512",
        "--kv-events-config",
        json.dumps(events),
        *extra,
        port=port,
        wait=wait,
        env=KEY_ENV,
    )
    return Engine(server, kv_port, replay_port)


def transfer_config(role: str, port: int, connector: str = "AtomPortableConnector", **extra) -> str:
    """--kv-transfer-config for a connector (the portable one by default) on 127.0.0.1."""
    return json.dumps(
        {
            "kv_connector": connector,
            "kv_role": role,
            "kv_ip": "127.0.0.1",
            "kv_port": port,
            "kv_connector_extra_config": extra,
        }
    )


def prompt_ids(seed: int, n: int = 150) -> list[int]:
    """A prompt of `n` token ids that shares no block with another seed's."""
    return [(i * 31 + seed * 7) % 480 + 5 for i in range(n)]


class RouterProcess(AtomProcess):
    """An `atom router` child process (bench/processes.py) and what tests read from it."""

    def __init__(
        self, port: int, args: tuple[str, ...], log_path: Path, env: dict | None = None
    ) -> None:
        super().__init__("router", port, args, log_path, env={**KEY_ENV, **(env or {})})
        self.headers: dict | None = None  # sent to its admin and metrics routes (--api-key)

    def backends(self) -> dict:
        return httpx.get(f"{self.url}/router/backends", timeout=10, headers=self.headers).json()

    def metric(self, name: str) -> float:
        return metric(self.url, name, self.headers)

    def wait_backends(self, role: str, healthy: int, timeout: float = 60) -> None:
        """Until exactly `healthy` backends of `role` are in rotation."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"atom router exited:\n{self.log()}")
            state = self.backends()[role]
            if sum(b["healthy"] for b in state) == healthy:
                return
            time.sleep(0.1)
        raise AssertionError(f"{role} backends never reached {healthy} healthy: {state}")

    def stop(self, timeout: float = 20.0) -> int:
        return super().stop(timeout)


def launch_router(
    tmp: Path, *args: str, timeout: float = 60, env: dict | None = None
) -> RouterProcess:
    port = free_port()
    router = RouterProcess(
        port, ("--probe-interval", "0.3", *args), tmp / f"router-{port}.log", env
    )
    try:
        router.wait_healthy(timeout)
    except RuntimeError:
        router.stop()
        raise
    return router


@pytest.fixture(scope="module")
def model_name(tiny_models) -> str:
    return str(tiny_models["llama"])

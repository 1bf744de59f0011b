"""An `atom` subcommand (`serve`, `router`) run as a child process on 127.0.0.1, for benchmarks and
tests that talk to it over HTTP: started in its own process group with its output in a log file,
waited for until /health answers 200, stopped with SIGTERM and then, if it hangs, SIGKILL to the
whole group (an API server's EngineCore and workers included)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

ATOM = Path(sys.executable).parent / "atom"  # the console script of this interpreter's install


def atom_command() -> list[str]:
    """How to run `atom` here: the console script when installed, else `python -m atom_runtime`
    (a source tree on PYTHONPATH, as on a benchmark machine)."""
    return [str(ATOM)] if ATOM.exists() else [sys.executable, "-m", "atom_runtime"]


class AtomProcess:
    """One `atom <command> --port PORT ...` child process and its log."""

    def __init__(
        self,
        command: str,
        port: int,
        args: tuple[str, ...] | list[str],
        log_path: Path,
        env: dict | None = None,
    ) -> None:
        self.command = command
        self.port = port
        self.log_path = log_path
        with log_path.open("w") as log:
            self.proc = subprocess.Popen(
                [*atom_command(), command, "--port", str(port), *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                start_new_session=True,  # its own process group, so stop() can kill all of it
            )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_healthy(self, timeout: float) -> None:
        """Until GET /health answers 200; raises with the log if the process exits first or
        `timeout` seconds (a deadlock guard) pass."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"atom {self.command} exited with {self.proc.returncode}:\n{self.log()}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=10).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"atom {self.command} was not healthy within {timeout}s:\n{self.log()}")

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM and wait for the exit code; the process group is killed if it hangs, and
        whatever of the group outlived its leader (an orphaned EngineCore) is killed too."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill_group()
        return self.proc.returncode

    def kill_group(self) -> None:
        """SIGKILL everything in the process group (it leads its own)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

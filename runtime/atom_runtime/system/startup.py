"""Where start-up time goes: one log line per phase, with its seconds, and the same figures for
`/metrics` (`atom:startup_seconds{phase}`, sent to the API server in EngineReady).

The phases, in order (each excludes the others, so they add up to the engine's start-up):

    config              resolve the model, read its config, plan threads and devices
    weights_read        from the start of loading until every weight byte was read from disk
    weights_on_device   the rest of loading: until every weight was on the device
    kv_cache            size (a profiling forward on a GPU) and allocate the KV cache
    kernel_autotune     batch-1 kernel timings, attention plans and kernel compiles
    graph_capture       CUDA graph capture
    warm_up             one short request through a prefill and a decode step
    tokenizer           (API server) the tokenizer, loaded once the engine is up
    ready               (API server) from `atom serve` starting to answering /health 200

Each process has one recorder (`recorder()`); an engine starts a fresh one (`restart()`). A
phase may be recorded in several parts (kernel autotune: attention plans, batch-1 timings,
compiles), each logged as it ends with what it was; `summary()` is the one line at the end.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger("atom_runtime.startup")

PHASES = (
    "config",
    "weights_read",
    "weights_on_device",
    "kv_cache",
    "kernel_autotune",
    "graph_capture",
    "warm_up",
    "tokenizer",
    "ready",
)
_LABELS = {p: p.replace("_", " ") for p in PHASES}
# Shorter records are kept (and exported) but not logged: on CPU most phases take no time.
LOG_FROM_S = 0.05


class StartupPhases:
    """Seconds per start-up phase, in the order they were first recorded."""

    def __init__(self, quiet: bool = False) -> None:
        self.seconds: dict[str, float] = {}
        self.notes: dict[str, str] = {}
        self.quiet = quiet  # tensor-parallel workers record without logging (rank 0 logs)

    @contextlib.contextmanager
    def phase(self, name: str, note: str = "") -> Iterator[None]:
        """Time the block as `name` (added to what the phase already has), logged at its end."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start, note)

    def add(self, name: str, seconds: float, note: str = "", quiet: bool = False) -> None:
        if name not in _LABELS:
            raise ValueError(f"phase: unknown start-up phase {name!r}; one of {', '.join(PHASES)}")
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        if note:
            self.notes[name] = note
        if not (quiet or self.quiet) and seconds >= LOG_FROM_S:
            log.info("start-up: %s %.2f s%s", _LABELS[name], seconds, f" ({note})" if note else "")

    def total(self) -> float:
        """The phases' seconds added up ("ready", the whole start, left out)."""
        return sum(v for k, v in self.seconds.items() if k != "ready")

    def summary(self) -> str:
        """One line: every phase recorded, in order, with its seconds."""
        parts = [
            f"{_LABELS[p]} {self.seconds[p]:.2f}"
            for p in PHASES
            if p in self.seconds and p != "ready"
        ]
        text = f"{self.total():.1f} s: " + ", ".join(parts)
        if "ready" in self.seconds:
            text = (
                f"ready in {self.seconds['ready']:.1f} s; phases {text} (the rest: processes "
                "starting, imports)"
            )
        return text


_recorder = StartupPhases()


def recorder() -> StartupPhases:
    """This process's recorder."""
    return _recorder


def restart(quiet: bool = False) -> StartupPhases:
    """A fresh recorder for a new engine in this process (returned, and now `recorder()`)."""
    global _recorder
    _recorder = StartupPhases(quiet)
    return _recorder


def process_started_at() -> float:
    """When this process started (epoch seconds), from /proc on Linux: the `ready` phase counts
    the interpreter's start and the first imports too; elsewhere, now."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # starttime: field 22 of stat(5), after pid and comm
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()

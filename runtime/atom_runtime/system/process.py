"""Process identity and GC policy for every long-lived ATOM process (contract 7, docs/architecture.md).

Each process entry point (API server, engine core, each worker) calls, in this order:

    set_process_title("EngineCore")      # first thing: `ps`/`top` show what this process is
    ...build the engine / load the model / warm up...
    apply_gc_policy()                    # collect, then freeze everything that survived warm-up
    ...serve...
    release_gc_policy()                  # at shutdown: unfreeze so teardown can free the engine

Why freeze: after warm-up the heap holds millions of long-lived objects (model modules, tokenizer
tables, FastAPI routes). Every full collection would walk them all for nothing; `gc.freeze()` moves
them to a permanent generation the collector skips. `ATOM_GC_FREEZE=0` falls back to raised
thresholds instead; `ATOM_GC_DEBUG=1` logs every collection with its generation, duration and
the number of objects it reclaimed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os
import re
import time
from dataclasses import dataclass

from atom_runtime import envs

log = logging.getLogger("atom_runtime.gc")

# Every ATOM process logs in this format (API server, engine core, workers, router).
LOG_FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"
# The one --log-level convention of every `atom` command: these choices, any case.
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def ensure_logging(level: int = logging.INFO) -> None:
    """Give ATOM's loggers a handler on stderr when the application configured none (the
    offline `LLM` in a script, as vLLM does for its own): start-up progress and errors are
    seen. An application that set up logging (any root handler) keeps full control."""
    ours = logging.getLogger("atom_runtime")
    if logging.getLogger().handlers or ours.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    ours.addHandler(handler)
    ours.setLevel(level)


def log_level(value: str) -> str:
    """argparse `type` of --log-level: the level in lower case, so DEBUG, Debug and debug all
    parse (and `choices=LOG_LEVELS` shows the same five names everywhere)."""
    return value.strip().lower()


FREEZE_ENV = envs.GC_FREEZE.name
DEBUG_ENV = envs.GC_DEBUG.name
# Used when freezing is turned off: young collections 70x rarer than CPython's default (700).
TUNED_THRESHOLDS = (50_000, 20, 20)
_ROLE = re.compile(r"[A-Z][A-Za-z0-9]*")


def process_title(role: str, dp_rank: int | None = None, tp_rank: int | None = None) -> str:
    """The one naming function: `ATOM::APIServer`, `ATOM::EngineCore`, `ATOM::EngineCore_DP1`,
    and `ATOM::DP0TP1` for a worker (any role with a tp_rank: the ranks say what it is)."""
    if not _ROLE.fullmatch(role):
        raise ValueError(f"role: must be a CamelCase word like 'EngineCore', got {role!r}")
    for name, rank in (("dp_rank", dp_rank), ("tp_rank", tp_rank)):
        if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or rank < 0):
            raise ValueError(f"{name}: must be an integer >= 0, got {rank!r}")
    if tp_rank is not None:
        return f"ATOM::DP{dp_rank or 0}TP{tp_rank}"
    if dp_rank is not None:
        return f"ATOM::{role}_DP{dp_rank}"
    return f"ATOM::{role}"


def set_process_title(role: str, dp_rank: int | None = None, tp_rank: int | None = None) -> str:
    """Set this process's title (as `ps` shows it) and multiprocessing name; returns the title."""
    import multiprocessing

    import setproctitle

    title = process_title(role, dp_rank, tp_rank)
    setproctitle.setproctitle(title)
    multiprocessing.current_process().name = title.removeprefix("ATOM::")
    return title


@dataclass(frozen=True)
class GCPolicy:
    """What `apply_gc_policy` did, for logs and tests."""

    frozen: bool  # True: gc.freeze(); False: TUNED_THRESHOLDS
    frozen_objects: int  # objects moved to the permanent generation (0 when not frozen)
    collected: int  # objects reclaimed by the collection before freezing
    debug: bool  # ATOM_GC_DEBUG=1: every collection is logged


class _CollectionLogger:
    """A gc.callbacks hook logging each collection's generation, duration and reclaimed count."""

    def __init__(self) -> None:
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        elapsed_ms = (time.perf_counter() - self._start) * 1000
        log.info(
            "gc: generation %d collection took %.3f ms, reclaimed %d objects (%d uncollectable)",
            info["generation"],
            elapsed_ms,
            info["collected"],
            info["uncollectable"],
        )


_debug_hook: _CollectionLogger | None = None
_default_thresholds = gc.get_threshold()


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    if value not in ("0", "1"):
        raise ValueError(f"{name}: must be 0 or 1, got {value!r}")
    return value == "1"


def apply_gc_policy() -> GCPolicy:
    """Call once after warm-up: collect, then freeze the survivors (or tune thresholds when
    ATOM_GC_FREEZE=0), and install the ATOM_GC_DEBUG collection logger."""
    global _debug_hook
    debug = _env_flag(DEBUG_ENV, False)
    if debug and _debug_hook is None:
        _debug_hook = _CollectionLogger()
        gc.callbacks.append(_debug_hook)
    collected = gc.collect()
    if _env_flag(FREEZE_ENV, True):
        gc.freeze()
        policy = GCPolicy(True, gc.get_freeze_count(), collected, debug)
    else:
        gc.set_threshold(*TUNED_THRESHOLDS)
        policy = GCPolicy(False, 0, collected, debug)
    log.debug("gc policy: %s", policy)
    return policy


def release_gc_policy() -> int:
    """Call at shutdown: unfreeze and restore default thresholds, so objects frozen at warm-up
    (the engine, its model, its caches) become collectable again; returns objects reclaimed."""
    global _debug_hook
    gc.unfreeze()
    gc.set_threshold(*_default_thresholds)
    reclaimed = gc.collect()
    if _debug_hook is not None:
        gc.callbacks.remove(_debug_hook)
        _debug_hook = None
    return reclaimed


def return_free_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim), after a large free such
    as an engine's CPU KV cache: glibc raises its mmap threshold after big frees (the weight
    loader's buffers), so later big tensors come from the heap, whose free pages it keeps. A
    no-op where the C library has no malloc_trim (musl, macOS)."""
    libc = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(libc), "malloc_trim", None) if libc else None
    if trim is not None:
        trim(0)

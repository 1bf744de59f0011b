"""Compiling guided requests' grammars off the engine-core thread.

A grammar (a JSON schema, a regex, a choice list, a Lark grammar) compiles in llguidance in time
that grows with its size: thousands of choices take a second. On the engine-core thread that
second would freeze every running stream. The engine loop instead hands a guided request's
`AddRequests` here; one worker thread compiles (llguidance releases the GIL while it works), and
the loop admits the request and answers its `AddResult` once the matchers are ready. The request
waits; nobody else does. An abort that arrives meanwhile drops the job when it is done.

The worker wakes the loop through a pipe whose read end the loop polls beside its inbox.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from atom_runtime.core.sequence import Sequence
from atom_runtime.protocol.engine_core import EngineRequest

log = logging.getLogger(__name__)


@dataclass(eq=False)
class GrammarJob:
    """One AddRequests message whose grammars are being compiled."""

    call_id: int
    requests: list[EngineRequest]
    seqs: list[Sequence]
    matchers: list = field(default_factory=list)
    error: str | None = None
    aborted: bool = False


class GrammarCompiler:
    def __init__(self, compile_one: Callable[[EngineRequest], object]) -> None:
        self._compile_one = compile_one
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="atom-grammar")
        self._lock = threading.Lock()
        self._done: list[GrammarJob] = []
        self._jobs: dict[int, GrammarJob] = {}  # by call id, until taken by `finished`
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)

    def fileno(self) -> int:
        """Readable when a job has finished (poll it beside the inbox)."""
        return self._read_fd

    def submit(self, call_id: int, requests: list[EngineRequest], seqs: list[Sequence]) -> None:
        job = GrammarJob(call_id, requests, seqs)
        self._jobs[call_id] = job
        self._pool.submit(self._run, job)

    def request_ids(self) -> set[str]:
        """Ids of the requests whose grammars are still compiling."""
        return {seq.request_id for job in self._jobs.values() for seq in job.seqs}

    def abort(self, request_ids: set[str]) -> None:
        """Drop the jobs of these requests (their compile still ends on its own)."""
        for job in self._jobs.values():
            if any(seq.request_id in request_ids for seq in job.seqs):
                job.aborted = True

    def finished(self) -> list[GrammarJob]:
        """Jobs compiled since the last call, aborted ones left out."""
        try:
            while os.read(self._read_fd, 4096):
                pass
        except BlockingIOError:
            pass
        with self._lock:
            done, self._done = self._done, []
        for job in done:
            del self._jobs[job.call_id]
        return [job for job in done if not job.aborted]

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        for fd in (self._read_fd, self._write_fd):
            os.close(fd)

    def _run(self, job: GrammarJob) -> None:
        try:
            job.matchers = [self._compile_one(request) for request in job.requests]
        except ValueError as e:
            job.error = str(e)
        except Exception as e:  # a compiler bug refuses the request, never the engine
            log.exception("compiling a grammar")
            job.error = f"structured_outputs: the grammar could not be compiled ({e!r})"
        with self._lock:
            self._done.append(job)
        try:
            os.write(self._write_fd, b"\0")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already

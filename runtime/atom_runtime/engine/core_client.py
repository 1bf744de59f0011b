"""The API server's side of the EngineCore process: spawn it, talk to it, notice when it dies.

One reader task receives every engine message. Step outputs go through the shared
OutputProcessor (n fan-out, detokenization, stop strings), which updates each request's live
state in place; the request's `RequestStream` is then woken, and its reader takes what is new
(no per-step snapshot is built). Stop-string finishes are aborted in the engine. The
process sentinel is watched on the event loop: when the engine core dies, every open stream
fails with EngineDeadError at once and `on_death` runs.

A hung engine core (a GPU kernel or collective that never returns) is alive but silent: it sends
something at least every HEARTBEAT_S, busy or idle, so a watchdog kills it when nothing has come
for `stall_timeout` seconds, and the death path above takes over (the server then exits and its
supervisor restarts it). A frontend event loop that was itself blocked does not count: the
watchdog skips a tick that woke up late, giving the reader the time to catch up first.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import zmq
import zmq.asyncio

from atom_runtime.config import EngineConfig
from atom_runtime.engine.core_proc import HEARTBEAT_S, run_engine_core
from atom_runtime.engine.output_processor import OutputProcessor, RequestState
from atom_runtime.protocol.codec import decoder, encoder
from atom_runtime.protocol.engine_core import (
    AbortRequests,
    AddRequests,
    AddResult,
    EngineMessage,
    EngineReady,
    EngineRequest,
    EngineStats,
    Outputs,
    Shutdown,
    StartupFailed,
    UtilityCall,
    UtilityResult,
    check_token_ids,
)

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The EngineCore process is gone; no request can be served any more."""


class EngineStartupError(RuntimeError):
    """The EngineCore process could not load the engine (the message says why)."""


class RequestStream:
    """Wakes the reader of one request when the engine brought it something. The request's state
    (`RequestState`) is live, updated in place by the output reader, so a reader that falls
    behind finds several steps' worth at once (one chunk) instead of a queue of them."""

    def __init__(self, state: RequestState) -> None:
        self.state = state
        # Set by a reader that only wants the finish from now on (a non-streamed request once
        # its first token was seen): tokens no longer wake it, the finish and errors do.
        self.finish_only = False
        self._news = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future | None = None

    def put(self) -> None:
        """The state changed (new tokens, a finish)."""
        self._news = True
        if not self.finish_only or self.state.finished:
            self._wake()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> RequestState:
        """The state, once it has changed since the last call (at once if it already has)."""
        if not self._news and self._error is None:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self._error is not None:
            raise self._error
        self._news = False
        return self.state


class EngineCoreClient:
    def __init__(
        self, config: EngineConfig, log_level: str = "INFO", stall_timeout: float = 0.0
    ) -> None:
        """`stall_timeout`: seconds without a message from the engine core after which it is
        taken for hung and killed (0 turns the watchdog off; must exceed HEARTBEAT_S)."""
        if stall_timeout < 0 or 0 < stall_timeout <= HEARTBEAT_S:
            raise ValueError(
                f"stall_timeout: expected 0 (off) or more than {HEARTBEAT_S} s, got {stall_timeout}"
            )
        self.config = config
        self.log_level = log_level
        self.stall_timeout = stall_timeout
        self.ready: EngineReady | None = None
        self.stats: EngineStats | None = None
        self.processor: OutputProcessor | None = None
        self.streams: dict[str, RequestStream] = {}
        self.dead = False
        self.death_reason = "the engine core process died"
        self.last_heard = time.monotonic()
        self.on_death: Callable[[], None] | None = None
        self._ids = itertools.count()
        self._calls: dict[int, asyncio.Future] = {}
        self._closing = False
        self._ctx = zmq.asyncio.Context()
        self._dir = Path(tempfile.mkdtemp(prefix="atom-engine-"))
        self._inbox_addr = f"ipc://{self._dir}/input"
        self._outbox_addr = f"ipc://{self._dir}/output"
        self._to_engine = self._ctx.socket(zmq.PUSH)
        self._to_engine.setsockopt(zmq.SNDHWM, 0)  # never queue-full: only "no engine" fails
        self._from_engine = self._ctx.socket(zmq.PULL)
        self._to_engine.bind(self._inbox_addr)
        self._from_engine.bind(self._outbox_addr)
        # Sends never wait (NOBLOCK, no high-water mark), so they go through a plain socket over
        # the same handle: the asyncio socket's send builds and schedules a future per message
        # (a tenth of the API server's CPU per request when many arrive at once).
        self._sender = zmq.Socket.shadow(self._to_engine.underlying)
        self._encoder = encoder()
        self._decoder = decoder(EngineMessage)
        self._reader: asyncio.Task | None = None
        self._watchdog: asyncio.Task | None = None
        self.proc: multiprocessing.process.BaseProcess | None = None

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> EngineReady:
        """Spawn the engine core and wait until it has loaded the model."""
        ctx = multiprocessing.get_context("spawn")
        self.proc = ctx.Process(
            target=run_engine_core,
            args=(asdict(self.config), self._inbox_addr, self._outbox_addr, self.log_level),
            name="EngineCore",
        )
        self.proc.start()
        loop = asyncio.get_running_loop()
        died = loop.create_future()
        loop.add_reader(self.proc.sentinel, lambda: died.done() or died.set_result(None))
        first = asyncio.ensure_future(self._from_engine.recv())
        await asyncio.wait([first, died], return_when=asyncio.FIRST_COMPLETED)
        if not first.done():
            first.cancel()
            self._watch_stop()
            raise EngineStartupError(f"the engine core exited with code {self._exitcode()}")
        msg = self._decoder.decode(first.result())
        if isinstance(msg, StartupFailed):
            self._watch_stop()
            raise EngineStartupError(msg.message)
        if not isinstance(msg, EngineReady):
            raise RuntimeError(
                f"engine core handshake: expected EngineReady, got {type(msg).__name__}"
            )
        self.ready = msg
        self.stats = msg.stats
        loop.remove_reader(self.proc.sentinel)
        loop.add_reader(self.proc.sentinel, self._engine_died)
        self.last_heard = time.monotonic()
        self._reader = asyncio.ensure_future(self._read_loop())
        if self.stall_timeout:
            self._watchdog = asyncio.ensure_future(self._watch_for_stalls())
        return msg

    def attach_processor(self, processor: OutputProcessor) -> None:
        self.processor = processor

    def _exitcode(self) -> int | None:
        if self.proc is None:
            return None
        self.proc.join(timeout=1)
        return self.proc.exitcode

    def _watch_stop(self) -> None:
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(self.proc.sentinel)

    def _engine_died(self) -> None:
        self._watch_stop()
        if self._closing:
            return
        self.dead = True
        log.error("%s (exit code %s)", self.death_reason, self._exitcode())
        error = EngineDeadError(self.death_reason)
        for stream in self.streams.values():
            stream.fail(error)
        self.streams.clear()
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(error)
        self._calls.clear()
        if self.on_death is not None:
            self.on_death()

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Ask the engine core to stop, then wait for it (terminate, then kill, if it hangs)."""
        self._closing = True
        self._watch_stop()
        if self.proc is not None and self.proc.is_alive():
            with contextlib.suppress(EngineDeadError):
                self._send(Shutdown())
            await asyncio.to_thread(self.proc.join, timeout)
            if self.proc.is_alive():
                log.warning("engine core did not stop in %.0fs; terminating it", timeout)
                self.proc.terminate()
                await asyncio.to_thread(self.proc.join, 2)
            if self.proc.is_alive():
                self.proc.kill()
                await asyncio.to_thread(self.proc.join, 2)
        for task in (self._reader, self._watchdog):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._to_engine.close(linger=0)
        self._from_engine.close(linger=0)
        self._ctx.term()
        for name in ("input", "output"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._dir / name)
        with contextlib.suppress(OSError):
            self._dir.rmdir()

    # -- requests --------------------------------------------------------------------------------

    async def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params,
        kv_transfer_params: dict | None = None,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Submit one API request (fanned out to n engine requests). Raises ValueError
        ("field: message") when the engine refuses it, EngineDeadError when it is gone."""
        if self.dead or self.processor is None:
            raise EngineDeadError("the engine core is not running")
        # Refused here too, not only in the engine: an id past int64 cannot even be sent.
        check_token_ids("prompt", prompt_token_ids, self.ready.vocab_size)
        reqs: list[EngineRequest] = self.processor.add_request(
            request_id, prompt, prompt_token_ids, params, kv_transfer_params, cache_salt
        )
        stream = RequestStream(self.processor.requests[request_id])
        self.streams[request_id] = stream
        try:
            result: AddResult = await self._call(AddRequests(0, reqs))
        except BaseException:
            # Cancelled (the client left) while the engine may still be admitting it, say
            # compiling its grammar: the engine must drop it, not run it for nobody.
            self.abort(request_id)
            raise
        if result.error is not None:
            self._forget(request_id)
            raise ValueError(result.error)
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request (client gone, server stopping); frees its blocks in the engine.
        Synchronous on purpose: it runs in `finally` blocks of cancelled tasks."""
        ids = self._forget(request_id)
        if ids and not self.dead and not self._closing:
            with contextlib.suppress(EngineDeadError):  # a dead engine holds no blocks
                self._send(AbortRequests(ids))

    def _forget(self, request_id: str) -> list[str]:
        self.streams.pop(request_id, None)
        return self.processor.abort(request_id) if self.processor is not None else []

    async def utility(self, method: str):
        result: UtilityResult = await self._call(UtilityCall(0, method))
        if result.error is not None:
            raise ValueError(result.error)
        return result.result

    async def _call(self, msg: AddRequests | UtilityCall):
        if self.dead:
            raise EngineDeadError("the engine core is not running")
        msg.call_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._calls[msg.call_id] = fut
        try:
            self._send(msg)
            return await fut
        finally:
            self._calls.pop(msg.call_id, None)

    def _send(self, msg) -> None:
        """Send without ever waiting: with no high-water mark a send only fails when no engine
        is connected (it exited), and then it must fail now, not hang."""
        try:
            self._sender.send(self._encoder.encode(msg), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            raise EngineDeadError("the engine core is not connected") from None

    # -- the reader ------------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        try:
            while True:
                frame = await self._from_engine.recv(copy=False)
                self.last_heard = time.monotonic()
                msg = self._decoder.decode(frame.buffer)
                if isinstance(msg, Outputs):
                    self._on_outputs(msg)
                elif isinstance(msg, (AddResult, UtilityResult)):
                    fut = self._calls.get(msg.call_id)
                    if fut is not None and not fut.done():
                        fut.set_result(msg)
                else:
                    raise RuntimeError(f"unexpected engine message {type(msg).__name__}")
        except asyncio.CancelledError:
            raise
        except Exception:
            # A frontend that cannot follow the engine is as good as a dead engine: fail loudly.
            log.exception("engine output reader failed")
            if self.proc is not None and self.proc.is_alive():
                self.proc.kill()

    async def _watch_for_stalls(self) -> None:
        tick = min(1.0, self.stall_timeout / 4)
        woke = time.monotonic()
        while not self.dead and not self._closing:
            await asyncio.sleep(tick)
            now = time.monotonic()
            slept, woke = now - woke, now
            if slept > 2 * tick:
                continue  # this loop was blocked: let the reader drain what queued up first
            silent = now - self.last_heard
            if silent > self.stall_timeout and self.proc is not None and self.proc.is_alive():
                self.death_reason = (
                    f"the engine core sent nothing for {silent:.0f} s (stall timeout "
                    f"{self.stall_timeout:g} s: a step that never finished); it was killed"
                )
                log.error("%s; in flight: %d requests", self.death_reason, len(self.streams))
                self.proc.kill()  # the sentinel then runs the death path
                return

    def _on_outputs(self, msg: Outputs) -> None:
        self.stats = msg.stats
        if not msg.outputs:
            return
        updated, to_abort = self.processor.process(msg.outputs)
        if to_abort:
            with contextlib.suppress(EngineDeadError):
                self._send(AbortRequests(to_abort))
        streams = self.streams
        for state in updated:
            stream = streams.get(state.request_id)
            if stream is not None:
                stream.put()
                if state.finished:
                    del streams[state.request_id]

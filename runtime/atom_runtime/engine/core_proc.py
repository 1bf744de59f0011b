"""The EngineCore process: the engine's busy loop behind two ZMQ sockets.

    API server ── PUSH ─(ClientMessage)──> PULL ┐
                                               EngineCore: drain inputs -> step() -> push outputs
    API server <─ PULL ─(EngineMessage)── PUSH ┘

The API server binds both sockets and spawns this process (multiprocessing spawn: no fork after
torch is imported; the only pickled thing is the spawn call's arguments, a plain dict of the
EngineConfig fields and two addresses). Everything on the sockets is msgspec msgpack, never
pickle: `ClientMessage` in, `EngineMessage` out (protocol/engine_core.py).

Startup: load the engine (each phase logged with its seconds, system/startup.py), apply the GC
policy, then send `EngineReady` with those seconds (or `StartupFailed` with the reason in one
line, and exit 1; the traceback is logged only at --log-level debug). A guided request's grammar
compiles on a worker thread (engine/grammar_compiler.py): its `AddResult` comes once it is
compiled and admitted, while the loop keeps stepping everyone else. While idle the loop sends a stats-only `Outputs` every HEARTBEAT_S, and exits
if its parent died. `Shutdown` aborts what is left, shuts the engine down and exits 0.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

from atom_runtime.engine.grammar_compiler import GrammarCompiler
from atom_runtime.protocol.codec import decoder, encoder, receive_waiting
from atom_runtime.protocol.engine_core import (
    AbortRequests,
    AddRequests,
    AddResult,
    ClientMessage,
    EngineReady,
    Outputs,
    RequestUpdate,
    Shutdown,
    StartupFailed,
    StepOutputs,
    UtilityCall,
    UtilityResult,
)

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0


UTILITY_METHODS = frozenset({"reset_prefix_cache", "cached_block_hashes"})


# -- the process ---------------------------------------------------------------------------------


def run_engine_core(
    config: dict, input_address: str, output_address: str, log_level: str = "INFO"
) -> None:
    """Entry point of the EngineCore process (a multiprocessing spawn target)."""
    import zmq

    from atom_runtime.system.process import (
        LOG_FORMAT,
        apply_gc_policy,
        release_gc_policy,
        set_process_title,
    )
    from atom_runtime.system.threads import mark_serving

    set_process_title("EngineCore", config.get("data_parallel_rank") or None)
    logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT)
    # Ctrl+C reaches the whole process group; the API server decides how we stop (Shutdown).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    parent = os.getppid()

    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, 2000)  # deliver a StartupFailed before exiting
    outbox.setsockopt(zmq.SNDHWM, 0)  # a send never blocks the loop; a gone parent is noticed
    inbox.connect(input_address)
    outbox.connect(output_address)
    encode = encoder().encode
    engine = None
    mark_serving()
    try:
        try:
            engine = _build_engine(config)
        except Exception as e:  # any load failure is reported, then this process exits 1
            # One line, said by the API server; the traceback only at --log-level debug.
            log.debug("engine core failed to start", exc_info=True)
            outbox.send(encode(StartupFailed(startup_error_message(e))))
            raise SystemExit(1) from None
        apply_gc_policy()
        outbox.send(
            encode(
                EngineReady(
                    model_path=str(engine.model_path),
                    eos_token_ids=list(engine.eos_token_ids),
                    max_model_len=engine.max_model_len,
                    device=str(engine.executor.device),
                    num_blocks=engine.pool.num_blocks,
                    block_size=engine.block_size,
                    vocab_size=engine.model_config.vocab_size,
                    max_num_batched_tokens=engine.max_num_batched_tokens,
                    stats=engine.stats(),
                    startup_seconds=dict(engine.startup.seconds),
                )
            )
        )
        EngineLoop(engine, inbox, outbox, parent).run()
    finally:
        if engine is not None:
            engine.shutdown()
        inbox.close(linger=0)
        outbox.close()
        ctx.term()
        release_gc_policy()


def startup_error_message(error: BaseException) -> str:
    """A start-up failure in one line: a refusal (ValueError, a missing file) says what it says;
    anything else is named by its type, as an unexpected error."""
    if isinstance(error, (ValueError, FileNotFoundError)):
        return str(error)
    return f"{type(error).__name__}: {error}"


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(0)


def _build_engine(config: dict):
    from atom_runtime.config import EngineConfig
    from atom_runtime.engine.core import EngineCore

    return EngineCore(EngineConfig(**config), prebuild_guides=True)


class EngineLoop:
    """Drain the inbox, step, push outputs; block on the inbox only while idle."""

    def __init__(self, engine, inbox, outbox, parent_pid: int) -> None:
        import zmq

        self.engine = engine
        self.inbox = inbox
        self.outbox = outbox
        self.parent_pid = parent_pid
        self.decoder = decoder(ClientMessage)
        self.encoder = encoder()
        self.poller = zmq.Poller()
        self.poller.register(inbox, zmq.POLLIN)
        self.grammars = GrammarCompiler(engine.compile_grammar)
        self.poller.register(self.grammars, zmq.POLLIN)
        self.running = True

    def run(self) -> None:
        last_sent = time.monotonic()
        while self.running:
            busy = self.engine.has_unfinished_requests()
            timeout_ms = 0 if busy else int(HEARTBEAT_S * 1000)
            aborted: list[RequestUpdate] = []
            if self.poller.poll(timeout_ms):
                aborted = self._drain_inbox()
                for job in self.grammars.finished():
                    self._send(self._admit(job.call_id, job.seqs, job.matchers, job.error))
            if not self.running:
                break
            pending = self.engine.step() if self.engine.has_unfinished_requests() else StepOutputs()
            if aborted:  # aborted before the step: it has no row of theirs
                pending.updates[:0] = aborted
            now = time.monotonic()
            if pending or now - last_sent >= HEARTBEAT_S:
                self._send(Outputs(pending, self.engine.stats()))
                last_sent = now
                if os.getppid() != self.parent_pid:
                    log.error("the API server (pid %d) is gone; exiting", self.parent_pid)
                    break
        self._abort_all()
        self.grammars.close()

    def _drain_inbox(self) -> list[RequestUpdate]:
        aborted: list[RequestUpdate] = []
        for msg in receive_waiting(self.inbox, self.decoder):
            if isinstance(msg, AddRequests):
                result = self._add(msg)
                if result is not None:
                    self._send(result)
            elif isinstance(msg, AbortRequests):
                self.grammars.abort(set(msg.request_ids))
                aborted += self.engine.abort_requests(msg.request_ids)
            elif isinstance(msg, UtilityCall):
                self._send(self._utility(msg))
            elif isinstance(msg, Shutdown):
                self.running = False
                break
        return aborted

    def _add(self, msg: AddRequests) -> AddResult | None:
        """Check and queue a message's requests, all or none; None while their grammars compile
        (the AddResult is sent once they are admitted)."""
        compiling = self.grammars.request_ids()
        try:
            seqs = [self.engine.prepare(req) for req in msg.requests]
            for seq in seqs:
                if seq.request_id in compiling:
                    raise ValueError(f"request_id: {seq.request_id!r} is already running")
        except ValueError as e:
            return AddResult(msg.call_id, str(e))
        if any(req.sampling_params.structured_outputs is not None for req in msg.requests):
            self.grammars.submit(msg.call_id, msg.requests, seqs)
            return None
        return self._admit(msg.call_id, seqs, [None] * len(seqs))

    def _admit(self, call_id: int, seqs, matchers: list, error: str | None = None) -> AddResult:
        added: list[str] = []
        if error is None:
            for seq, matcher in zip(seqs, matchers, strict=True):
                try:
                    self.engine.admit(seq, matcher)
                except ValueError as e:
                    error = str(e)
                    break
                added.append(seq.request_id)
        if error is not None:
            self.engine.abort_requests(added)
        return AddResult(call_id, error)

    def _utility(self, msg: UtilityCall) -> UtilityResult:
        if msg.method not in UTILITY_METHODS:
            return UtilityResult(msg.call_id, error=f"method: unknown utility {msg.method!r}")
        return UtilityResult(msg.call_id, getattr(self.engine, msg.method)())

    def _abort_all(self) -> None:
        ids = list(self.engine.scheduler.requests)
        if ids:
            log.info("aborting %d unfinished requests at shutdown", len(ids))
            self.engine.abort_requests(ids)

    def _send(self, msg: Any) -> None:
        self.outbox.send(self.encoder.encode(msg), copy=False)

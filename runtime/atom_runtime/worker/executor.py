"""Where the model runs: in this process (one rank), or across tensor-parallel ranks.

`make_executor` returns a `ModelRunner` for `tensor_parallel_size == 1` and a `TPExecutor`
otherwise; both are an `Executor`: what EngineCore uses.

TPExecutor: rank 0 runs in this process (the engine core, next to the scheduler and block
manager); ranks 1..N-1 are worker processes (worker.py, multiprocessing spawn), each on its own
GPU (`cuda:<rank>`) or, on CPU, its slice of the cores. Each rank loads only its shard of the
weights and holds its KV heads' part of the cache; all ranks agree on the block count (the
smallest that fits everywhere), so rank 0's block ids are valid on every rank.

A step: rank 0 turns the batch into `StepInputs` (host arrays), sends them as they are to every
worker (msgspec over ZMQ, one PUSH socket per worker; protocol/worker.py), runs the same forward
(the layers' all-reduce and all-gather run on the torch.distributed group: gloo on CPU, NCCL on
GPUs), and samples alone.
Why ZMQ and not a torch.distributed broadcast for the inputs: the send never blocks on a dead
worker, the batch's shape needs no extra header collective, NCCL would need a second (CPU) group
for host arrays anyway, and control calls share the channel, so they stay ordered with the steps.

Liveness: rank 0 watches the workers' process sentinels before and after every step and while it
waits for a control call. A dead rank makes the current call (or the next one) raise a
RuntimeError naming the rank and its exit code; gloo collectives fail at once when a peer's
connection closes, NCCL collectives are aborted by a watcher thread, and every collective has a
timeout (ATOM_TP_TIMEOUT_S) for a peer that hangs alive. After a failure the executor is down:
every later call raises the same error.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import threading
import time
import weakref
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

import torch

from atom_runtime.config import EngineConfig
from atom_runtime.core.batch import ScheduledBatch
from atom_runtime.core.sequence import Sequence
from atom_runtime.models.config import ModelConfig
from atom_runtime.protocol import codec
from atom_runtime.protocol import worker as wire
from atom_runtime.spec_decode.proposer import StepRecord
from atom_runtime.system.device import resolve_device
from atom_runtime.system.distributed import (
    abort_tensor_parallel,
    destroy_tensor_parallel,
    init_tensor_parallel,
    tp_size,
)
from atom_runtime.system.threads import configure_cpu_threads
from atom_runtime.worker.model_runner import ModelRunner
from atom_runtime.worker.sampler import SamplerOutput
from atom_runtime.worker.tp_worker import WorkerSpec, run_worker

log = logging.getLogger(__name__)

DEATH_WAIT_S = 2.0  # after a collective fails: how long to wait for the culprit's exit to show
SHUTDOWN_WAIT_S = 10.0  # a worker gets this long to answer `shutdown` and exit before SIGTERM
POLL_MS = 100  # waits on workers wake this often to look at their sentinels


class Executor(Protocol):
    """What EngineCore needs from the place the model runs."""

    num_blocks: int  # KV cache blocks, the same on every rank
    max_num_batched_tokens: int  # the step token budget the cache was sized for
    device: torch.device  # rank 0's device
    eos_token_ids: list[int]  # set by the engine: banned until a request's min_tokens

    def capture_cudagraphs(self, max_model_len: int) -> None:
        """Warm up (CUDA graphs for decode steps where enabled) before serving."""

    def execute(self, batch: ScheduledBatch) -> tuple[list[Sequence], SamplerOutput | None]:
        """Run one step: the sequences that sample this step and their samples (on the device,
        on their way back), or ([], None) when none samples."""

    def copy_state(self, unit_rows) -> None:
        """Run state-checkpoint copies alone (no forward pass follows; hybrid models)."""

    def step_record(self) -> StepRecord:
        """Speculative decoding: what the last step leaves its drafter, kept apart from later
        steps (async scheduling proposes for a step once the next one was launched)."""

    def propose(self, seqs: list[Sequence], record: StepRecord | None = None) -> list[list[int]]:
        """Speculative decoding: drafts for a step's live sequences, from its `record` (None:
        the last step's)."""

    def shutdown(self) -> None:
        """Free the device memory (and stop any worker process); idempotent."""


def make_executor(config: EngineConfig, model_config: ModelConfig, model_path: Path) -> Executor:
    if config.tensor_parallel_size == 1:
        return ModelRunner(config, model_config, model_path)
    return TPExecutor(config, model_config, model_path)


def _from_runner(name: str) -> property:
    """A read-only attribute of the executor that is rank 0's model runner's."""
    return property(lambda self: getattr(self.runner, name), doc=f"ModelRunner.{name}")


class TPExecutor:
    """Rank 0 of a tensor-parallel group, driving the worker processes of ranks 1..N-1."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, model_path: Path) -> None:
        import zmq

        n = config.tensor_parallel_size
        if n < 2:
            raise ValueError(f"tensor_parallel_size: TPExecutor needs >= 2 ranks, got {n}")
        if tp_size() != 1:
            raise RuntimeError(
                "this process already runs a tensor-parallel engine; shut it down first"
            )
        device = resolve_device(config.device)
        if device.type == "cuda" and torch.cuda.device_count() < n:
            raise ValueError(
                f"tensor_parallel_size: {n} ranks need {n} GPUs, this machine has "
                f"{torch.cuda.device_count()}"
            )
        self.world_size = n
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self._failure: str | None = None
        self._closed = False
        self._call_ids = itertools.count(1)
        self._encoder = codec.encoder()
        self._decoder = codec.decoder(wire.FromWorker)
        self._failed_messages: dict[int, str] = {}
        self.worker_gc_policies: list[dict] = []

        self._zmq = zmq
        reply_address, command_addresses = self._open_sockets(n)
        # Each rank gets its slice of the cores (system/threads.py; rank 0 included, restored at
        # shutdown): EngineCore planned this process's share already, the workers take the same.
        self._saved_threads = torch.get_num_threads()
        threads = configure_cpu_threads(config.cpu_threads, n).threads
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self._spawn_workers(
            config, model_path, init_method, reply_address, command_addresses, threads
        )
        self._start_ranks(config, model_config, model_path, init_method)

    def _open_sockets(self, n: int) -> tuple[str, list[str]]:
        """The PULL socket every worker replies to and one PUSH socket per worker, all on
        127.0.0.1 (the ranks of one engine share a host)."""
        zmq = self._zmq
        self._ctx = zmq.Context()
        self._replies = self._ctx.socket(zmq.PULL)
        reply_port = self._replies.bind_to_random_port("tcp://127.0.0.1")
        self._commands = []
        command_addresses = []
        for _ in range(1, n):
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDTIMEO, int(SHUTDOWN_WAIT_S * 1000))
            port = sock.bind_to_random_port("tcp://127.0.0.1")
            self._commands.append(sock)
            command_addresses.append(f"tcp://127.0.0.1:{port}")
        return f"tcp://127.0.0.1:{reply_port}", command_addresses

    def _spawn_workers(
        self,
        config: EngineConfig,
        model_path: Path,
        init_method: str,
        reply_address: str,
        command_addresses: list[str],
        threads: int,
    ) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.workers: list[multiprocessing.process.BaseProcess] = []
        for rank in range(1, self.world_size):
            spec = WorkerSpec(
                rank=rank,
                world_size=self.world_size,
                engine_config=asdict(config),
                model_path=str(model_path),
                dist_init_method=init_method,
                backend=self.backend,
                command_address=command_addresses[rank - 1],
                reply_address=reply_address,
                parent_pid=os.getpid(),
                num_threads=threads,
                log_level=logging.getLevelName(logging.getLogger().getEffectiveLevel()),
            )
            proc = ctx.Process(target=run_worker, args=(asdict(spec),), name=f"TP{rank}")
            proc.daemon = True  # never outlives this process, even if shutdown is skipped
            proc.start()
            self.workers.append(proc)
        # Reaps the workers and the process group if this executor is dropped without shutdown.
        self._finalizer = weakref.finalize(self, _abandon, list(self.workers))

    def _start_ranks(
        self, config: EngineConfig, model_config: ModelConfig, model_path: Path, init_method: str
    ) -> None:
        """Join the process group, load rank 0's shard, and check every rank sized the same
        cache; any failure stops the workers and names the rank that failed."""
        n = self.world_size
        try:
            self._wait_for(wire.WorkerHello, "start")
            init_tensor_parallel(0, n, init_method, self.backend)
            self.runner = ModelRunner(config, model_config, model_path)
            readies = self._wait_for(wire.WorkerReady, "load the model")
        except BaseException as e:
            # A collective failing (RuntimeError) usually means a worker died: report that one.
            # Anything else is rank 0's own error (a bad config, a bad checkpoint): raise it.
            failure = self._find_dead_worker(DEATH_WAIT_S) if isinstance(e, RuntimeError) else None
            # Workers may sit in a collective rank 0 left: no polite shutdown, stop them.
            self._failure = failure or f"rank 0 failed to start: {type(e).__name__}: {e}"
            self.shutdown()
            if failure is not None:
                raise RuntimeError(failure) from e
            raise
        for ready in readies:
            if ready.num_blocks != self.runner.num_blocks:
                self._failure = (
                    f"tensor-parallel rank {ready.rank} sized its KV cache at {ready.num_blocks} "
                    f"blocks, rank 0 at {self.runner.num_blocks}: the ranks must agree"
                )
                self.shutdown()
                raise RuntimeError(self._failure)
        self._stop_watch = threading.Event()
        self._watcher = None
        if self.backend == "nccl":
            # NCCL spins on a dead peer until its timeout: abort the group as soon as one dies.
            self._watcher = threading.Thread(target=self._watch, name="tp-liveness", daemon=True)
            self._watcher.start()
        log.info("tensor parallel: %d ranks (%s), %d KV blocks", n, self.backend, self.num_blocks)

    # -- what EngineCore uses ----------------------------------------------------------------------

    # Rank 0's runner answers for every rank (they sized the same cache, load the same model).
    num_blocks = _from_runner("num_blocks")
    max_num_batched_tokens = _from_runner("max_num_batched_tokens")
    num_state_slots = _from_runner("num_state_slots")
    state_bytes_per_slot = _from_runner("state_bytes_per_slot")
    checkpoint_spec = _from_runner("checkpoint_spec")
    device = _from_runner("device")

    @property
    def eos_token_ids(self) -> list[int]:
        return self.runner.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: list[int]) -> None:
        self.runner.eos_token_ids = ids

    def capture_cudagraphs(self, max_model_len: int) -> None:
        """Warm-up on every rank at once (graph capture runs collectives), then the GC policy in
        every worker: their long-lived heaps are complete now."""
        call_id = self._send_call("capture_cudagraphs", [max_model_len])
        self._guarded(self.runner.capture_cudagraphs, max_model_len)
        self._collect(call_id)
        self.worker_gc_policies = self.call_workers("apply_gc_policy")

    def execute(self, batch: ScheduledBatch) -> tuple[list[Sequence], SamplerOutput | None]:
        self._check_alive()
        inputs, samplers = self.runner.prepare_inputs(batch)
        self._send_all(self._encoder.encode(inputs))
        logits = self.runner.take_prompt_logprobs(self._guarded(self.runner.forward, inputs))
        self._check_alive()
        if logits is None:
            return [], None
        return samplers, self.runner.sample(logits, samplers)

    def copy_state(self, unit_rows) -> None:
        """Every rank copies its own shard of the checkpoint images."""
        call_id = self._send_call("copy_state", [[list(r) for r in unit_rows.tolist()]])
        self._guarded(self.runner.copy_state, unit_rows)
        self._collect(call_id)

    def step_record(self) -> StepRecord:
        return self.runner.step_record()

    def propose(self, seqs: list[Sequence], record: StepRecord | None = None) -> list[list[int]]:
        """Drafts come from rank 0 alone (a drafting model runs whole there, outside the group);
        the other ranks see them as token ids in the next step's inputs."""
        return self.runner.propose(seqs, record)

    def call_workers(self, method: str, args: list | None = None) -> list[Any]:
        """Run a worker method (worker.WORKER_METHODS) on ranks 1..N-1; their return values in
        rank order. Raises RuntimeError if a rank dies or fails instead of answering."""
        return self._collect(self._send_call(method, args or []))

    def parameter_bytes(self) -> list[int]:
        """Bytes of model parameters held by each rank, rank 0 first."""
        own = sum(p.numel() * p.element_size() for p in self.runner.model.parameters())
        return [own, *self.call_workers("parameter_bytes")]

    def shutdown(self) -> None:
        """Stop every worker (each answers `shutdown`, frees its runner and exits; stragglers are
        terminated), free rank 0's KV cache and leave the process group. Idempotent."""
        if self._closed:
            return
        if getattr(self, "_stop_watch", None) is not None:
            self._stop_watch.set()  # workers exiting now is expected: no abort
        asked = self._failure is None and all(p.is_alive() for p in self.workers)
        if asked:
            # Each worker answers and exits; its exit is what is waited for (the answer may
            # still be on its way when the process is gone).
            self._send_call("shutdown", [])
        self._closed = True
        _reap(self.workers, wait_s=SHUTDOWN_WAIT_S)
        if asked:  # a worker told to stop that did not exit cleanly
            for rank, proc in enumerate(self.workers, start=1):
                if proc.exitcode != 0:
                    log.warning("tensor-parallel shutdown: %s", _death_message(rank, proc, None))
        self._finalizer.detach()
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.shutdown()
        try:
            destroy_tensor_parallel()
        except Exception:  # a failed group may not tear down cleanly; the state is reset anyway
            log.debug("destroying the process group failed", exc_info=True)
        for sock in (*self._commands, self._replies):
            sock.close(linger=0)
        self._ctx.term()
        torch.set_num_threads(self._saved_threads)

    # -- liveness ----------------------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self._failure is not None:
            raise RuntimeError(self._failure)
        if self._closed:
            raise RuntimeError("the tensor-parallel executor is shut down")
        failure = self._find_dead_worker(0)
        if failure is not None:
            self._fail(failure)

    def _guarded(self, fn, *args):
        """Run a part of the step that pairs up with the workers. If it fails, the ranks are out
        of step (workers may sit in a collective rank 0 left), so the engine goes down; a worker's
        death is reported in place of the collective's symptom."""
        try:
            return fn(*args)
        except Exception as e:
            failure = self._failure or self._find_dead_worker(DEATH_WAIT_S)
            self._fail(failure or f"rank 0 failed mid-step: {type(e).__name__}: {e}", e)

    def _find_dead_worker(self, wait_s: float) -> str | None:
        """A message naming the first dead worker (waiting up to wait_s for one), else None."""
        by_sentinel = {p.sentinel: rank for rank, p in enumerate(self.workers, start=1)}
        dead = multiprocessing.connection.wait(list(by_sentinel), timeout=wait_s)
        if not dead:
            return None
        rank = min(by_sentinel[s] for s in dead)
        proc = self.workers[rank - 1]
        proc.join(1.0)
        self._drain_replies()
        return _death_message(rank, proc, self._failed_messages.get(rank))

    def _fail(self, message: str, cause: BaseException | None = None) -> None:
        """Take the engine down: remember why, stop the other ranks, raise."""
        if self._failure is None:
            self._failure = message
            log.error("%s; stopping the engine", message)
            if getattr(self, "_stop_watch", None) is not None:
                self._stop_watch.set()
            _reap(self.workers, wait_s=0)
        raise RuntimeError(self._failure) from cause

    def _watch(self) -> None:
        sentinels = [p.sentinel for p in self.workers]
        while not self._stop_watch.is_set():
            if multiprocessing.connection.wait(sentinels, timeout=POLL_MS / 1000):
                if not self._stop_watch.is_set():
                    log.error("a tensor-parallel worker died; aborting collectives in flight")
                    abort_tensor_parallel()
                return

    # -- messages ----------------------------------------------------------------------------------

    def _send_all(self, frame: bytes) -> None:
        for rank, sock in enumerate(self._commands, start=1):
            try:
                sock.send(frame, self._zmq.NOBLOCK, copy=False)
                continue
            except self._zmq.Again:  # no connection (a dead worker) or a full queue
                pass
            failure = self._find_dead_worker(DEATH_WAIT_S)
            if failure is not None:
                self._fail(failure)
            try:
                sock.send(frame, copy=False)  # bounded by SNDTIMEO
            except self._zmq.Again:
                self._fail(f"tensor-parallel rank {rank} stopped taking work")

    def _send_call(self, method: str, args: list) -> int:
        self._check_alive()
        call_id = next(self._call_ids)
        self._send_all(self._encoder.encode(wire.WorkerCall(call_id, method, args)))
        return call_id

    def _collect(self, call_id: int, timeout_s: float | None = None) -> list[Any]:
        results = self._wait_for(wire.WorkerResult, f"answer call {call_id}", call_id, timeout_s)
        return [r.value for r in results]

    def _wait_for(self, kind, what: str, call_id: int | None = None, timeout_s=None) -> list:
        """One `kind` message from every worker, in rank order; a worker that dies or fails
        first raises RuntimeError within POLL_MS."""
        got: dict[int, Any] = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while len(got) < len(self.workers):
            for msg in self._drain_replies(POLL_MS):
                if isinstance(msg, kind) and (call_id is None or msg.call_id == call_id):
                    got[msg.rank] = msg
            if len(got) == len(self.workers):
                break
            failure = self._find_dead_worker(0)
            if failure is None and self._failed_messages:
                rank = min(self._failed_messages)
                failure = f"tensor-parallel rank {rank} failed: {self._failed_messages[rank]}"
            if failure is not None:
                self._fail(failure)
            if deadline is not None and time.monotonic() > deadline:
                missing = sorted(set(range(1, self.world_size)) - set(got))
                raise RuntimeError(f"tensor-parallel ranks {missing} did not {what} in time")
        return [got[rank] for rank in sorted(got)]

    def _drain_replies(self, timeout_ms: int = 0) -> list:
        """Messages waiting on the reply socket (waiting up to timeout_ms for the first);
        `WorkerFailed` reports are kept for the death message."""
        if not self._replies.poll(timeout_ms):
            return []
        out = list(codec.receive_waiting(self._replies, self._decoder))
        for msg in out:
            if isinstance(msg, wire.WorkerFailed):
                self._failed_messages[msg.rank] = msg.message
        return out


def _death_message(rank: int, proc, reported: str | None) -> str:
    code = proc.exitcode
    if code is None:
        how = "stopped answering"
    elif code < 0:
        how = f"was killed by {signal.Signals(-code).name} (exit code {code})"
    else:
        how = f"exited with code {code}"
    message = f"tensor-parallel rank {rank} (pid {proc.pid}) {how}"
    return f"{message}: {reported}" if reported else message


def _reap(workers: list, wait_s: float = 0.0) -> None:
    """Make sure no worker outlives its executor: wait a little, then SIGTERM, then SIGKILL."""
    deadline = time.monotonic() + wait_s
    for proc in workers:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in workers:
        if proc.is_alive():
            proc.terminate()
    for proc in workers:
        proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(2.0)


def _abandon(workers: list) -> None:
    """An executor dropped without shutdown: stop its workers and leave the process group."""
    _reap(workers)
    try:
        destroy_tensor_parallel()
    except Exception:
        log.debug("destroying the process group failed", exc_info=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

"""A tensor-parallel worker: the process that owns rank r > 0 of the model (one per rank).

Rank 0 lives in the engine-core process with the scheduler (executor.py); it spawns one of these
per other rank. A worker builds its shard of the model and its part of the KV cache, then runs
whatever rank 0 sends, in order:

    rank 0 ── PUSH (one socket per worker) ──> PULL  worker    StepInputs | WorkerCall
    rank 0 <── PULL (one socket for all) ───── PUSH  worker    WorkerHello | WorkerReady
                                                               | WorkerResult | WorkerFailed

`StepInputs` is one forward pass as plain arrays (token ids, positions, slot mapping, block
tables, sequence lengths, sample rows). The worker runs the same forward as rank 0; the layers'
all-reduces and the LM head's all-gather pair the ranks up, and only rank 0 samples, so a step
has no reply. `WorkerCall` runs one of WORKER_METHODS and always answers with a `WorkerResult`,
so a caller waiting on it never hangs. Any exception is reported as `WorkerFailed` and the
worker exits 1:
rank 0 then takes the engine down with that message (a rank half-way through a collective cannot
be resumed). The worker also exits when its parent (rank 0's process) is gone.

Everything on the sockets is msgspec msgpack (protocol/worker.py), never pickle; the spawn call's
only argument is a plain dict (`WorkerSpec` as a dict).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
from pathlib import Path
from typing import Any

from atom_runtime.protocol.codec import decoder, encoder
from atom_runtime.protocol.worker import (
    StepInputs,
    ToWorker,
    WorkerFailed,
    WorkerHello,
    WorkerReady,
    WorkerResult,
)

log = logging.getLogger(__name__)

PARENT_POLL_MS = 1000  # how often an idle worker checks that rank 0's process is still there


# -- the process ---------------------------------------------------------------------------------


@dataclasses.dataclass
class WorkerSpec:
    """What a worker needs to start; crosses the spawn boundary as a plain dict."""

    rank: int
    world_size: int
    engine_config: dict  # EngineConfig fields
    model_path: str
    dist_init_method: str  # tcp://127.0.0.1:<port> for torch.distributed
    backend: str  # gloo (CPU) or nccl (CUDA/ROCm)
    command_address: str  # rank 0's PUSH socket for this worker
    reply_address: str  # rank 0's PULL socket
    parent_pid: int
    num_threads: int  # torch CPU threads: this rank's slice of the cores
    log_level: str = "INFO"


def run_worker(spec: dict) -> None:
    """Entry point of a worker process (a multiprocessing spawn target)."""
    import torch
    import zmq

    from atom_runtime.system.process import release_gc_policy, set_process_title

    s = WorkerSpec(**spec)
    set_process_title("Worker", s.engine_config.get("data_parallel_rank", 0), s.rank)
    logging.basicConfig(
        level=s.log_level.upper(),
        format="%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s",
    )
    # Ctrl+C reaches the whole process group; rank 0 decides how we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    torch.set_num_threads(s.num_threads)

    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, 2000)
    inbox.connect(s.command_address)
    outbox.connect(s.reply_address)
    encode = encoder().encode
    code = 0
    try:
        outbox.send(encode(WorkerHello(s.rank, os.getpid())))
        worker = Worker(s)
        outbox.send(encode(WorkerReady(s.rank, worker.runner.num_blocks)))
        worker.serve(inbox, outbox)
    except SystemExit:
        raise
    except BaseException as e:
        # Rank 0 reports this message in one line; the traceback only at --log-level debug.
        log.debug("tensor-parallel rank %d failed", s.rank, exc_info=True)
        outbox.send(encode(WorkerFailed(s.rank, f"{type(e).__name__}: {e}")))
        code = 1
    finally:
        _destroy_tensor_parallel()
        inbox.close(linger=0)
        outbox.close()
        ctx.term()
        release_gc_policy()
    if code:
        raise SystemExit(code)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(0)


def _destroy_tensor_parallel() -> None:
    from atom_runtime.system.distributed import destroy_tensor_parallel

    try:
        destroy_tensor_parallel()
    except Exception:  # a peer already gone: nothing left to tear down cleanly
        log.debug("destroying the process group failed", exc_info=True)


class Worker:
    """One rank's model runner, driven by rank 0's messages."""

    def __init__(self, spec: WorkerSpec) -> None:
        from atom_runtime.config import EngineConfig
        from atom_runtime.models.loader import load_model_config
        from atom_runtime.system import startup
        from atom_runtime.system.distributed import init_tensor_parallel
        from atom_runtime.worker.model_runner import ModelRunner

        self.spec = spec
        startup.restart(quiet=True)  # rank 0 logs the start-up phases
        init_tensor_parallel(spec.rank, spec.world_size, spec.dist_init_method, spec.backend)
        path = Path(spec.model_path)
        self.runner = ModelRunner(EngineConfig(**spec.engine_config), load_model_config(path), path)
        self.running = True
        self.kv_transfer = None  # this rank's KV transport, when the engine transfers KV

    def serve(self, inbox, outbox) -> None:
        import zmq

        decode = decoder(ToWorker).decode
        encode = encoder().encode
        poller = zmq.Poller()
        poller.register(inbox, zmq.POLLIN)
        while self.running:
            if not poller.poll(PARENT_POLL_MS):
                if os.getppid() != self.spec.parent_pid:
                    log.error("rank 0 (pid %d) is gone; exiting", self.spec.parent_pid)
                    return
                continue
            msg = decode(inbox.recv(copy=False).buffer)
            if isinstance(msg, StepInputs):
                self.runner.forward(msg)
            else:
                value = self.call(msg.method, msg.args)
                outbox.send(encode(WorkerResult(msg.call_id, self.spec.rank, value)))

    def call(self, method: str, args: list) -> Any:
        if method not in WORKER_METHODS:
            raise ValueError(f"method: unknown worker method {method!r}")
        return getattr(self, method)(*args)

    # -- WORKER_METHODS: what rank 0 may call; each returns a msgpack-able value ---------------

    def capture_cudagraphs(self, max_model_len: int) -> list[int]:
        self.runner.capture_cudagraphs(max_model_len)
        return list(self.runner.graphs.sizes)

    def apply_gc_policy(self) -> dict:
        from atom_runtime.system.process import apply_gc_policy

        return dataclasses.asdict(apply_gc_policy())

    def copy_state(self, unit_rows: list[list[int]]) -> None:
        import numpy as np

        self.runner.copy_state(np.array(unit_rows, dtype=np.int64).reshape(-1, 3))

    def start_kv_transfer(self, spec: dict) -> bool:
        """Start this rank's KV transport (prefill/decode disaggregation), linked to rank 0:
        spec = {"config": the --kv-transfer-config JSON, "links": {rank: rank 0's address}}."""
        from atom_runtime.kv_transfer import start_rank_transport

        rank = self.spec.rank
        self.kv_transfer = start_rank_transport(
            self.runner, self.runner.model_config, spec["config"], rank, spec["links"][str(rank)]
        )
        return True

    def parameter_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.runner.model.parameters())

    def shutdown(self) -> bool:
        if self.kv_transfer is not None:
            self.kv_transfer.close()
            self.kv_transfer = None
        self.runner.shutdown()
        self.running = False
        return True


WORKER_METHODS = frozenset(
    {
        "capture_cudagraphs",
        "apply_gc_policy",
        "parameter_bytes",
        "copy_state",
        "start_kv_transfer",
        "shutdown",
    }
)

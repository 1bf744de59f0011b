"""Messages between tensor-parallel rank 0 and the worker processes of ranks r > 0
(worker/executor.py, worker/tp_worker.py): one tagged union each way (`ToWorker`, `FromWorker`).
A step's inputs are numpy arrays, carried as (dtype, shape, bytes) by protocol/codec.py."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

# -- tensor-parallel rank 0 -> worker --------------------------------------------------------------


class StepInputs(msgspec.Struct, tag="step", array_like=True):
    """Everything a forward pass needs, as host arrays: rank 0 builds it from a scheduled batch
    (ModelRunner.prepare_inputs) and sends it as is to every worker, which runs the same forward."""

    input_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    slot_mapping: np.ndarray  # int64 [T]: cache slot of each new token
    block_tables: np.ndarray  # int32 [B, max_blocks]
    seq_lens: np.ndarray  # int32 [B]: tokens in cache per sequence, this step's included
    cu_seqlens_q: np.ndarray  # int32 [B+1]: prefix sums of each sequence's new tokens
    max_seqlen_q: int
    sample_rows: np.ndarray  # int64 [S]: token rows whose logits are sampled
    # Async scheduling: int64 [2, P], input rows whose token the previous step sampled on the
    # device (row 0) and that step's sample row holding it (row 1). Rank 0 only: async
    # scheduling is refused under tensor parallelism, so a worker always gets None.
    pending_sources: np.ndarray | None = None
    # Hybrid models: each sequence's committed state slot (int32 [B]) and whether it resumes
    # from it (bool [B]; False: the first chunk since admission, which starts from zero state).
    state_slots: np.ndarray | None = None
    has_initial_state: np.ndarray | None = None
    # A speculative verify step of a hybrid model: int32 [B, 1 + k], the slots each verified
    # row reads and leaves its per-token states in (-1 rows: prompt chunks, whose
    # `state_slots` entry is used instead; a verified row's `state_slots` entry is -1).
    spec_slots: np.ndarray | None = None
    # State checkpoints: the unit table (int64 [R, 3], maintenance.UnitCopyTable.rows) of the
    # copies to run before this forward; each rank translates it for its own shard.
    state_copy: np.ndarray | None = None
    # KV groups (sliding-window layers with blocks of their own): their slot mapping (int64
    # [T]) and block tables (int32 [B, max_blocks], 0 where the window has passed).
    window_slot_mapping: np.ndarray | None = None
    window_block_tables: np.ndarray | None = None

    @property
    def decode_only(self) -> bool:
        return self.max_seqlen_q == 1


class WorkerCall(msgspec.Struct, tag="call", array_like=True):
    """Run one of tp_worker.WORKER_METHODS; always answered by a WorkerResult (or WorkerFailed)."""

    call_id: int
    method: str
    args: list[Any] = []


ToWorker = StepInputs | WorkerCall


# -- worker -> tensor-parallel rank 0 --------------------------------------------------------------


class WorkerHello(msgspec.Struct, tag="hello", array_like=True):
    """Sent once the worker's imports are done, just before it joins the process group."""

    rank: int
    pid: int


class WorkerReady(msgspec.Struct, tag="ready", array_like=True):
    """The worker's shard is loaded and its KV cache sized (every rank must agree on it)."""

    rank: int
    num_blocks: int


class WorkerResult(msgspec.Struct, tag="result", array_like=True):
    call_id: int
    rank: int
    value: Any = None


class WorkerFailed(msgspec.Struct, tag="failed", array_like=True):
    rank: int
    message: str


FromWorker = WorkerHello | WorkerReady | WorkerResult | WorkerFailed

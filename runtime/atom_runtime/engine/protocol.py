"""The wire protocol: every message that crosses a process boundary inside one engine.

Two channels, each a pair of ZMQ sockets carrying msgspec msgpack (never pickle):

    API server / LLM client ──(ClientMessage)──> EngineCore process       (engine/core_proc.py)
                            <──(EngineMessage)──
    tensor-parallel rank 0  ──(ToWorker)──────> worker of rank r > 0      (executor.py, worker.py)
                            <──(FromWorker)────

Each direction is one tagged union, so a decoder accepts exactly what the other side sends.
Token ids are lists here (this is a wire edge); a step's inputs are numpy arrays, carried as
(dtype, shape, bytes) by the hooks of `encoder()` / `decoder()`: use those two on every socket.
Sockets to external parties (KV events, kv_events/) speak their own, fixed format.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np

from atom_runtime.kv_transfer.stats import KVTransferStats
from atom_runtime.sampling_params import SamplingParams
from atom_runtime.state.checkpoint_metrics import StateCheckpointCounters


def check_token_ids(field: str, ids, vocab_size: int) -> None:
    """ValueError naming `field` for the first id outside [0, vocab_size). An `array("i")`
    (a prompt the engine has converted) is checked in one numpy pass (2 us for 8k ids, against
    ~150 us id by id); the id-by-id walk then only runs to name the bad id."""
    if isinstance(ids, array) and ids.typecode == "i":
        view = np.frombuffer(ids, dtype=np.int32)
        if view.size == 0 or (view.min() >= 0 and view.max() < vocab_size):
            return
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"{field}: token id {bad} is outside the vocabulary [0, {vocab_size})")


# -- the engine's requests, outputs and stats ----------------------------------------------------


class EngineRequest(msgspec.Struct, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    kv_transfer_params: dict | None = None


class RequestUpdate(msgspec.Struct, array_like=True, omit_defaults=True):
    """The facts about one request that come once, not with every token: sent with its first
    token (prompt size, prefix-cache hit, engine timestamps, prompt logprobs when asked for) and
    when it finishes (why; its kv_transfer_params), an abort included."""

    request_id: str
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # Engine-side timestamps (time.time()): first scheduled, first token.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    num_preemptions: int = 0
    # The request's kv_transfer_params, returned with its finish: a KV-transfer producer's say
    # where the prompt's blocks wait for a pull (kv_transfer/agent.py); otherwise the engine
    # hands back what it was given, so a P/D proxy's bookkeeping survives the round trip.
    kv_transfer_params: dict | None = None
    # prompt_logprobs, with the first token: per prompt token from the second on.
    prompt_logprobs: list[float] | None = None
    prompt_top_ids: list[list[int]] | None = None
    prompt_top_logprobs: list[list[float]] | None = None
    prompt_ranks: list[int] | None = None  # each prompt token's rank among the vocabulary


class StepOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    """What the engine produced since its last message, as columns: row i is token `token_ids[i]`
    of request `request_ids[i]` (a request's rows in the order sampled), with its logprob and
    top alternatives when any request of the step asked for logprobs (a row of a request that
    asked for none holds the sampled token's logprob and no alternatives). Then `updates`, the
    once-per-request facts, which apply after the rows (a finish comes after its last token).
    One list per column instead of one object per request per token: building, encoding,
    decoding and reading a step's outputs costs a few list operations per token."""

    request_ids: list[str] = []
    token_ids: list[int] = []
    logprobs: list[float] | None = None
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    updates: list[RequestUpdate] = []

    def __len__(self) -> int:
        """How many tokens and updates this holds (0: nothing happened)."""
        return len(self.token_ids) + len(self.updates)

    def tokens_by_request(self) -> dict[str, list[int]]:
        """Each request's new tokens, in order (requests with an update but no token: absent)."""
        out: dict[str, list[int]] = {}
        for rid, token in zip(self.request_ids, self.token_ids, strict=True):
            out.setdefault(rid, []).append(token)
        return out

    def finished(self) -> dict[str, RequestUpdate]:
        """The updates that finish a request, by request id."""
        return {u.request_id: u for u in self.updates if u.finish_reason is not None}


class EngineStats(msgspec.Struct, array_like=True):
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_blocks: int
    block_size: int
    prefix_queries: int  # prompt tokens looked up in the prefix cache, cumulative
    prefix_hits: int  # of which served from the cache, cumulative
    num_preemptions: int  # cumulative
    prompt_tokens: int  # cumulative prompt tokens computed
    generation_tokens: int  # cumulative tokens generated
    kv_events_published: int = 0
    kv_events_dropped: int = 0
    # Hybrid models: the state slot pool (0 for models without recurrent state).
    state_slots_total: int = 0
    state_slots_in_use: int = 0
    state_slot_bytes: int = 0
    kv_transfer: KVTransferStats | None = None  # with --kv-transfer-config
    # Hybrid models with state checkpoints on: their counters (None otherwise).
    state_checkpoints: StateCheckpointCounters | None = None


# -- client (API server) -> EngineCore process -----------------------------------------------------


class AddRequests(msgspec.Struct, tag="add", array_like=True):
    """Queue these engine requests (the n children of one API request) all or none; answered
    by one AddResult carrying `call_id`."""

    call_id: int
    requests: list[EngineRequest]


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, tag="utility", array_like=True):
    """Call one of core_proc.UTILITY_METHODS on the engine; answered by a UtilityResult."""

    call_id: int
    method: str


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


ClientMessage = AddRequests | AbortRequests | UtilityCall | Shutdown


# -- EngineCore process -> client ------------------------------------------------------------------


class EngineReady(msgspec.Struct, tag="ready", array_like=True):
    """The engine is loaded and serving: what the frontend needs to know about it."""

    model_path: str
    eos_token_ids: list[int]
    max_model_len: int
    device: str
    num_blocks: int
    block_size: int
    vocab_size: int
    max_num_batched_tokens: int  # the step token budget
    stats: EngineStats  # so /metrics has engine numbers from the first scrape on


class StartupFailed(msgspec.Struct, tag="failed", array_like=True):
    message: str


class Outputs(msgspec.Struct, tag="outputs", array_like=True):
    """One step's outputs (empty for a heartbeat) and the engine's stats after it."""

    outputs: StepOutputs
    stats: EngineStats


class AddResult(msgspec.Struct, tag="added", array_like=True):
    call_id: int
    error: str | None = None  # "field: message" from EngineCore.add_request


class UtilityResult(msgspec.Struct, tag="result", array_like=True):
    call_id: int
    result: Any = None
    error: str | None = None


EngineMessage = EngineReady | StartupFailed | Outputs | AddResult | UtilityResult


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
    # State checkpoints: the unit table (int64 [R, 3], maintenance.UnitCopyTable.rows) of the
    # copies to run before this forward; each rank translates it for its own shard.
    state_copy: np.ndarray | None = None

    @property
    def decode_only(self) -> bool:
        return self.max_seqlen_q == 1


class WorkerCall(msgspec.Struct, tag="call", array_like=True):
    """Run one of worker.WORKER_METHODS; always answered by a WorkerResult (or WorkerFailed)."""

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


# -- codecs ---------------------------------------------------------------------------------------


def _encode_custom(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        a = np.ascontiguousarray(obj)
        return (a.dtype.str, a.shape, a.data)  # e.g. ("<i8", (3,), raw bytes)
    raise NotImplementedError(f"cannot put a {type(obj).__name__} on the wire")


def _decode_custom(kind: type, obj: Any) -> Any:
    if kind is np.ndarray:
        dtype, shape, data = obj
        # Writable, so torch.from_numpy takes the array without a warning.
        return np.frombuffer(bytearray(data), dtype=np.dtype(dtype)).reshape(shape)
    raise NotImplementedError(f"cannot read a {kind.__name__} from the wire")


def encoder() -> msgspec.msgpack.Encoder:
    """The encoder of every message in this module."""
    return msgspec.msgpack.Encoder(enc_hook=_encode_custom)


def decoder(kind: Any) -> msgspec.msgpack.Decoder:
    """A decoder of `kind` (one of this module's unions)."""
    return msgspec.msgpack.Decoder(kind, dec_hook=_decode_custom)


def receive_waiting(sock, decoder: msgspec.msgpack.Decoder) -> Iterator[Any]:
    """Decode every message already waiting on a ZMQ socket, never waiting for one."""
    import zmq

    while True:
        try:
            frame = sock.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return
        yield decoder.decode(frame.buffer)

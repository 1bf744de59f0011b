"""Messages between the API server (or `LLM`) and the EngineCore process (engine/core_proc.py).

One tagged union each way (`ClientMessage` in, `EngineMessage` out), so a decoder accepts exactly
what the other side sends; encode and decode them with protocol/codec.py. Token ids are lists here
(this is a wire edge)."""

from __future__ import annotations

from array import array
from typing import Any

import msgspec
import numpy as np

from atom_runtime.protocol.checkpoint_counters import StateCheckpointCounters
from atom_runtime.protocol.kv_transfer_stats import KVTransferStats
from atom_runtime.protocol.spec_decode_stats import SpecDecodingStats
from atom_runtime.sampling_params import SamplingParams


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
    cache_salt: str | None = None  # vLLM's: the prompt's prefix-cache entries are this tenant's


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
    # Returned with its finish by a KV-transfer producer only: where the prompt's blocks wait
    # for a pull (kv_transfer/agent.py), for the router that asked. The engine never echoes the
    # params it was given (they name internal addresses and a signature).
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
    # With --speculative-config: drafted and accepted tokens (None otherwise).
    spec_decoding: SpecDecodingStats | None = None


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
    # Seconds per start-up phase (system/startup.py), for atom:startup_seconds{phase}.
    startup_seconds: dict[str, float] = msgspec.field(default_factory=dict)


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

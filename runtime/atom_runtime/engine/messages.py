"""Messages between a frontend (LLM, the API server) and the EngineCore.

msgspec Structs, so they cross the ZMQ socket as msgpack (no pickle). Token ids are lists here:
this is a wire edge.
"""

from __future__ import annotations

import msgspec

from atom_runtime.kv_transfer.stats import KVTransferStats
from atom_runtime.sampling_params import SamplingParams


def check_token_ids(field: str, ids, vocab_size: int) -> None:
    """ValueError naming `field` for the first id outside [0, vocab_size)."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"{field}: token id {bad} is outside the vocabulary [0, {vocab_size})")


class EngineRequest(msgspec.Struct, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    kv_transfer_params: dict | None = None


class EngineOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one step produced for one request: new tokens, and the finish if it finished."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float] | None = None
    new_top_ids: list[list[int]] | None = None
    new_top_logprobs: list[list[float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # Engine-side timestamps (time.time()): first scheduled, first token.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    num_preemptions: int = 0
    # The request's kv_transfer_params, returned with its final output. With no KV connector the
    # engine hands back what it was given, so a P/D proxy's bookkeeping survives the round trip.
    kv_transfer_params: dict | None = None
    # prompt_logprobs, with the first output: per prompt token from the second on.
    prompt_logprobs: list[float] | None = None
    prompt_top_ids: list[list[int]] | None = None
    prompt_top_logprobs: list[list[float]] | None = None
    prompt_ranks: list[int] | None = None  # each prompt token's rank among the vocabulary


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
    kv_transfer: KVTransferStats | None = None  # with --kv-transfer-config

"""Sequence: one request's tokens and progress through the engine.

Everything that grows once per token is an `array` (one object instead of thousands, less GC
work); only the JSON edges convert to lists.
"""

from __future__ import annotations

import enum
import time
from array import array

from atom_runtime.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"  # aborted by the client or the server


class Sequence:
    """One request. The scheduler moves it between queues; the block manager owns its blocks."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: array | list[int],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        if len(prompt_token_ids) == 0:
            raise ValueError("prompt: must contain at least one token")
        self.request_id = request_id
        self.token_ids = array("i", prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        # Tokens whose KV is in the cache. Reset to 0 on preemption (recompute).
        self.num_computed_tokens = 0
        # Prompt tokens served from the prefix cache at first admission (reported as cached_tokens).
        self.num_cached_tokens = 0
        self.block_table: list[int] = []
        # Chained hashes of this sequence's full blocks, computed once each, in order.
        self.block_hashes: list[int] = []
        # Leading blocks of block_table that carry their hash (prefix hits or published blocks).
        self.num_hashed_blocks = 0
        # Sampled-token logprob per output token, and, when logprobs=k>0, k (id, logprob)
        # alternatives per output token, flattened.
        self.output_logprobs = array("f")
        self.top_logprob_ids = array("i")
        self.top_logprobs = array("f")
        self.num_preemptions = 0
        self.kv_transfer_params: dict | None = None
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> array:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> array:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int, logprob: float | None = None) -> None:
        self.token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)

    def finish(self, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason

"""Sequence: one request's tokens and progress through the engine.

Everything that grows once per token is an `array` (one object instead of thousands, less GC
work); only the JSON edges convert to lists.
"""

from __future__ import annotations

import enum
import time
from array import array

from atom_runtime.sampling_params import SamplingParams

# Stands in the token list for a token sampled on the GPU but not yet read back (async scheduling).
PENDING_TOKEN = -1


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
        # Block ids, grown by the block manager: an array, so the model runner copies a row
        # into its step's table as one buffer copy instead of converting a list per step.
        self.block_table = array("i")
        # Models whose sliding-window layers keep their own blocks (KV group 1): those, index
        # for index beside block_table; -1 where the window has passed and the block went back.
        self.window_table = array("i")
        self.window_start = 0  # window_table's entries before this one are -1
        # Hybrid models: state slots held while resident ([0] committed, then scratch).
        self.state_slots: list[int] = []
        # Chained hashes of this sequence's full blocks, computed once each, in order.
        self.block_hashes: list[int] = []
        # Leading blocks of block_table that carry their hash (prefix hits or published blocks).
        self.num_hashed_blocks = 0
        # The first block's hash parent: None, or the request's cache_salt mixed in
        # (protocol/block_hash.py), so salted and unsalted prompts never share a block.
        self.hash_root: int | None = None
        self.num_preemptions = 0
        # kv_transfer_params as the engine acts on them (router-signed, checked); and what a
        # KV-transfer producer answers when the request finishes (where its blocks are held).
        self.kv_transfer_params: dict | None = None
        self.kv_transfer_reply: dict | None = None
        # Async scheduling: trailing PENDING_TOKEN entries (sampled, not yet read back), and
        # whether the first of them is known to end the sequence by length, so it needs no
        # further step.
        self.num_pending = 0
        self.final_pending = False
        # Launched steps of this sequence whose outputs are not applied yet (`Scheduler.commit`
        # to `update_from_output`): under async scheduling, the step in flight.
        self.steps_in_flight = 0
        # Speculative decoding: the drafts proposed to follow the last token, and how many of
        # them the step in flight runs after it (placed at the tail of token_ids by the
        # scheduler, taken off again by `take_verified`).
        self.spec_token_ids: list[int] = []
        self.num_spec = 0
        # The first position whose KV the drafting model lacks though the target has it: KV
        # pulled from a prefill engine (kv_transfer) holds the target's layers only. A draft
        # model's next catch-up starts there (spec_decode/model_drafter.py); None: no gap.
        self.draft_kv_from: int | None = None
        # Penalties read the output tokens themselves, a grammar's mask needs the last token
        # consumed: such a sequence never runs on pending ones (the scheduler skips it while
        # its token is in flight).
        self.needs_token_history = (
            sampling_params.has_penalties or sampling_params.structured_outputs is not None
        )
        self.matcher = None  # llguidance matcher of a guided sequence (structured_outputs.py)
        # prompt_logprobs: per prompt token from the second on, (logprob, top ids, top logprobs,
        # rank), filled as the prompt's chunks run; sent once, with the first output token.
        self.prompt_lp: list[tuple[float, list[int], list[float], int]] = []
        self.prompt_lp_sent = False
        self.wants_prompt_lp = sampling_params.prompt_logprobs is not None
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

    def prompt_lp_wanted(self, start: int, end: int) -> range:
        """Positions in [start, end) whose logits give a prompt token's logprob still missing
        (position p predicts prompt token p + 1)."""
        if self.sampling_params.prompt_logprobs is None:
            return range(0)
        return range(max(start, len(self.prompt_lp)), min(end, self.num_prompt_tokens - 1))

    def known_end(self, max_model_len: int) -> int | None:
        """The token count this sequence finishes at, when nothing but its length can end it:
        EOS ignored, no stop token ids or strings, no grammar, max_tokens set. None otherwise.
        (An abort can still end it earlier.)"""
        p = self.sampling_params
        if (
            not p.ignore_eos
            or p.max_tokens is None
            or p.stop_token_ids
            or p.stop
            or p.structured_outputs is not None
        ):
            return None
        return min(self.num_prompt_tokens + p.max_tokens, max_model_len)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_pending(self, max_model_len: int) -> None:
        """Reserve the place of a token this step samples; `resolve_pending` fills it in."""
        self.token_ids.append(PENDING_TOKEN)
        self.num_pending += 1
        max_tokens = self.sampling_params.max_tokens
        if self.num_tokens >= max_model_len or (
            max_tokens is not None and self.num_output_tokens >= max_tokens
        ):
            self.final_pending = True

    def resolve_pending(self, token_id: int) -> None:
        """The oldest pending token is now known."""
        self.token_ids[len(self.token_ids) - self.num_pending] = token_id
        self.num_pending -= 1

    def drop_pending(self) -> None:
        """Forget pending tokens (the sequence finished before them)."""
        if self.num_pending:
            del self.token_ids[len(self.token_ids) - self.num_pending :]
            self.num_pending = 0

    def place_drafts(self, drafts: list[int]) -> None:
        """Put the drafts this step verifies after the last token (the model runner reads a
        step's inputs from token_ids)."""
        if self.num_spec or self.num_pending:
            raise RuntimeError(f"{self!r}: drafts placed over a step still in flight")
        self.token_ids.extend(drafts)
        self.num_spec = len(drafts)

    def take_verified(self, num_accepted: int) -> None:
        """The verify step is back: drop its pending token and its drafts (the accepted ones
        come back among the tokens it emitted) and count only the accepted drafts' KV as
        computed."""
        if not 0 <= num_accepted <= self.num_spec:
            raise ValueError(f"num_accepted: {num_accepted} outside [0, {self.num_spec}]")
        self.drop_pending()
        self.final_pending = False
        if self.num_spec:
            del self.token_ids[len(self.token_ids) - self.num_spec :]
            self.num_computed_tokens -= self.num_spec - num_accepted
            self.num_spec = 0

    def _drop_drafts(self) -> None:
        """Finished (aborted) with drafts placed: they were never tokens of its text."""
        if self.num_spec:
            self.drop_pending()
            self.take_verified(0)

    def finish(self, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        self._drop_drafts()
        self.drop_pending()
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason

"""Frontend bookkeeping shared by `LLM` and the API server: fan-out of `n`, incremental
detokenization, stop strings, and the vLLM-shaped RequestOutput.

Each request's state (`RequestState`, one `SequenceText` per choice) is updated in place as the
engine's outputs arrive. The API server streams from that live state, reading only what is new
since its last chunk (a slow reader finds several steps' worth at once); `RequestState.output()`
takes the vLLM-shaped snapshot `LLM` returns, once per finished request. Nothing is copied per
token.

Stop strings live here, not in the engine core: only text knows them. When one matches, the
request is finished here and its id is handed back so the caller aborts it in the engine.
"""

from __future__ import annotations

import dataclasses
import time
from array import array
from dataclasses import dataclass

from tokenizers.decoders import DecodeStream

from atom_runtime.protocol.engine_core import EngineRequest, RequestUpdate, StepOutputs
from atom_runtime.sampling_params import SamplingParams
from atom_runtime.text.tokenizer import Tokenizer


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """When a request went through the engine, as vLLM's RequestMetrics: wall-clock times
    (time.time()) from the frontend (arrival, last token, finish) and the engine (first
    scheduled, first token)."""

    arrival_time: float
    last_token_time: float  # the arrival time until a token came
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    time_in_queue: float | None = None  # first scheduled - arrival
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    kv_transfer_params: dict | None = None
    # With prompt_logprobs: per prompt token, {its id: logprob, and the top ones}; None first;
    # and each prompt token's rank (1: the model's first choice there).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None


class SequenceText:
    """One completion's growing text: detokenized token by token, checked for stop strings."""

    def __init__(self, index: int, params: SamplingParams, tokenizer: Tokenizer | None) -> None:
        self.index = index
        self.params = params
        self.hf = tokenizer.hf if tokenizer is not None else None
        self.want_logprobs = params.logprobs is not None
        self.stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        self.text = ""
        self.token_ids = array("i")
        self.logprobs = array("f")
        self.top: list[dict[int, float]] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.stop = params.stop or []
        self.hold = max((len(s) for s in self.stop), default=1) - 1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def streamable_len(self) -> int:
        """How much of `text` is safe to show now: the tail that could still begin a stop string
        is held back until the completion finishes."""
        if self.finish_reason is not None or not self.hold:
            return len(self.text)
        return max(0, len(self.text) - self.hold)

    @property
    def streamable_text(self) -> str:
        return self.text[: self.streamable_len]

    def append_token(
        self,
        token: int,
        logprob: float = 0.0,
        top_ids: list[int] | None = None,
        top_logprobs: list[float] | None = None,
    ) -> bool:
        """Add one sampled token (with its logprob and alternatives when this completion asked
        for logprobs). Returns True when a stop string finished this completion."""
        self.token_ids.append(token)
        if self.want_logprobs:
            self.logprobs.append(logprob)
            top = {token: logprob}
            if top_ids:
                top.update(zip(top_ids, top_logprobs, strict=True))
            self.top.append(top)
        piece = self.stream.step(self.hf, token) if self.hf is not None else None
        if piece:
            before = len(self.text)
            self.text += piece
            if self.stop and self._check_stop(before):
                return True
        return False

    def _check_stop(self, new_from: int) -> bool:
        start = max(0, new_from - self.hold)
        best = None
        for s in self.stop:
            at = self.text.find(s, start)
            if at != -1 and (best is None or at < best[0]):
                best = (at, s)
        if best is None:
            return False
        at, s = best
        self.text = (
            self.text[: at + len(s)] if self.params.include_stop_str_in_output else self.text[:at]
        )
        self.finish_reason = "stop"
        self.stop_reason = s
        return True

    def completion(self) -> CompletionOutput:
        want = self.params.logprobs is not None
        return CompletionOutput(
            index=self.index,
            text=self.streamable_text,
            token_ids=self.token_ids.tolist(),
            cumulative_logprob=float(sum(self.logprobs)) if want else None,
            logprobs=list(self.top) if want else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


class RequestState:
    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer | None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.children = {
            child_id(request_id, i, params.n): SequenceText(i, params, tokenizer)
            for i in range(params.n)
        }
        self.sequences = list(self.children.values())  # in choice order
        self.num_unfinished = params.n
        self.num_cached_tokens = 0
        self.kv_transfer_params: dict | None = None
        self.prompt_logprobs: list[dict[int, float] | None] | None = None
        self.prompt_logprob_ranks: list[int | None] | None = None
        now = time.time()
        self.metrics = RequestMetrics(arrival_time=now, last_token_time=now)

    @property
    def finished(self) -> bool:
        return not self.num_unfinished

    @property
    def num_output_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.sequences)

    def output(self) -> RequestOutput:
        """A snapshot, shaped as vLLM's RequestOutput (copies every token so far)."""
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[c.completion() for c in self.sequences],
            finished=self.finished,
            num_cached_tokens=self.num_cached_tokens,
            metrics=dataclasses.replace(self.metrics),
            kv_transfer_params=self.kv_transfer_params,
            prompt_logprobs=self.prompt_logprobs,
            prompt_logprob_ranks=self.prompt_logprob_ranks,
        )

    def take_update(self, update: RequestUpdate) -> None:
        """The engine's once-per-request facts: cache hit, returned kv_transfer_params, prompt
        logprobs, first-scheduled and first-token times (the earliest of the n children)."""
        self.num_cached_tokens = max(self.num_cached_tokens, update.num_cached_tokens)
        if update.kv_transfer_params is not None:
            self.kv_transfer_params = update.kv_transfer_params
        if update.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.take_prompt_logprobs(update)
        m = self.metrics
        if update.first_scheduled_time is not None and m.first_scheduled_time is None:
            m.first_scheduled_time = update.first_scheduled_time
            m.time_in_queue = update.first_scheduled_time - m.arrival_time
        if update.first_token_time is not None and m.first_token_time is None:
            m.first_token_time = update.first_token_time

    def take_prompt_logprobs(self, out: RequestUpdate) -> None:
        ids = self.prompt_token_ids
        entries: list[dict[int, float] | None] = [None]
        for i, lp in enumerate(out.prompt_logprobs):
            entry = {ids[i + 1]: lp}
            entry.update(zip(out.prompt_top_ids[i], out.prompt_top_logprobs[i], strict=True))
            entries.append(entry)
        self.prompt_logprobs = entries
        self.prompt_logprob_ranks = [None, *out.prompt_ranks]


def child_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{request_id}#{index}"


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        # None: no tokenizer (dummy weights from a bare config); completions carry token ids only.
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self._parent: dict[str, str] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kv_transfer_params: dict | None = None,
        cache_salt: str | None = None,
    ) -> list[EngineRequest]:
        """Track a request; returns the engine requests to submit (n of them for n > 1; seeded
        children get seed + index so their samples differ but stay reproducible)."""
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        state = RequestState(request_id, prompt, prompt_token_ids, params, self.tokenizer)
        self.requests[request_id] = state
        out = []
        for i, cid in enumerate(state.children):
            child_params = params
            if params.n > 1:
                seed = None if params.seed is None else params.seed + i
                child_params = params.clone(n=1, seed=seed)
            self._parent[cid] = request_id
            out.append(
                EngineRequest(
                    cid,
                    prompt_token_ids,
                    child_params,
                    state.metrics.arrival_time,
                    kv_transfer_params,
                    cache_salt,
                )
            )
        return out

    def process(self, outputs: StepOutputs) -> tuple[list[RequestState], list[str]]:
        """Apply what the engine sent: its token rows, then its updates. Returns the requests
        they changed (live: read them now, or take `output()`; a finished one is no longer
        tracked here) and the engine request ids that a stop string finished (to abort in the
        engine, unless the engine finished them in the same message)."""
        touched: dict[str, RequestState] = {}
        stopped: list[str] = []
        now = time.time()
        parents, requests = self._parent, self.requests
        logprobs = outputs.logprobs
        for row, (cid, token) in enumerate(
            zip(outputs.request_ids, outputs.token_ids, strict=True)
        ):
            parent = parents.get(cid)
            if parent is None:
                continue  # already finished here (e.g. a stop string), engine still catching up
            state = requests[parent]
            child = state.children[cid]
            if child.finish_reason is not None:
                continue  # a stop string ended it at an earlier row of this message
            if logprobs is None:
                hit = child.append_token(token)
            else:
                top_ids, top_lps = outputs.top_ids[row], outputs.top_logprobs[row]
                hit = child.append_token(token, logprobs[row], top_ids, top_lps)
            state.metrics.last_token_time = now
            touched[parent] = state
            if hit:
                stopped.append(cid)
        engine_finished = set()
        for update in outputs.updates:
            cid = update.request_id
            parent = parents.get(cid)
            if parent is None:
                continue
            state = requests[parent]
            state.take_update(update)
            if update.finish_reason is not None:
                engine_finished.add(cid)
                child = state.children[cid]
                if child.finish_reason is None:  # else a stop string came first: it stands
                    child.finish_reason = update.finish_reason
                    child.stop_reason = update.stop_reason
                self._finish_child(state, cid, now)
            touched[parent] = state
        to_abort = []
        for cid in stopped:
            if cid not in engine_finished:
                to_abort.append(cid)
                self._finish_child(requests[parents[cid]], cid, now)
        return list(touched.values()), to_abort

    def _finish_child(self, state: RequestState, cid: str, now: float) -> None:
        del self._parent[cid]
        state.num_unfinished -= 1
        if not state.num_unfinished:
            state.metrics.finished_time = now
            del self.requests[state.request_id]

    def abort(self, request_id: str) -> list[str]:
        """Forget a request; returns its engine request ids to abort."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return []
        ids = [cid for cid in state.children if cid in self._parent]
        for cid in ids:
            del self._parent[cid]
        return ids

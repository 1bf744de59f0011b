"""One API request in flight: a `Run` per prompt (its engine stream and timings), `merged` (the
states of several runs as they change), the `_Shape` every chunk of its response shares, and
`RequestCut`, how a shutdown ends it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from atom_runtime.engine.core_client import EngineDeadError, RequestStream
from atom_runtime.engine.output_processor import RequestState
from atom_runtime.sampling_params import SamplingParams
from atom_runtime.server import responses as R
from atom_runtime.server.reasoning import ChoiceReasoning
from atom_runtime.server.tools import ToolPlan


class RequestCut(Exception):
    """The server is shutting down and the request did not finish within the grace period."""


def _retrieve(task: asyncio.Future) -> None:
    """Done-callback of helper tasks nobody awaits: mark their outcome seen, so a task that
    failed or was cancelled after its request ended logs no "exception was never retrieved"."""
    if not task.cancelled():
        task.exception()


@dataclass
class Run:
    """One prompt of an API request, as submitted to the engine (its n choices together). Its
    state is live (updated by the engine client's reader); `finished` turns True once the
    reader of this run has been handed the finished state, not merely when the engine got
    there, so a stream never stops before its last chunk."""

    request_id: str
    api_request_id: str  # the HTTP request's id (request_id is it, or it + "-<prompt index>")
    prompt_index: int
    stream: RequestStream
    num_prompt_tokens: int
    arrival: float  # time.monotonic() when the HTTP request arrived
    arrival_wall: float  # time.time() then, to compare with the engine's timestamps
    first_token_at: float | None = None
    finished: bool = False

    @property
    def state(self) -> RequestState:
        return self.stream.state

    async def next(self) -> RequestState:
        """The state once it changed: read what is new before awaiting again."""
        state = await self.stream.get()
        if self.first_token_at is None and state.num_output_tokens:
            self.first_token_at = time.monotonic()
        self.finished = state.finished
        return state

    async def final(self) -> RequestState:
        """The finished state. Woken by the first token (the TTFT) and then by the finish only,
        not once per step."""
        while not self.finished:
            await self.next()
            if self.first_token_at is not None:
                self.stream.finish_only = True
        return self.state


async def merged(runs: list[Run]) -> AsyncIterator[tuple[Run, RequestState]]:
    """Each run's state whenever it changed (one helper task per run), until every run's
    finished state was handed out."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(run: Run) -> None:
        try:
            while not run.finished:
                queue.put_nowait((run, await run.next()))
        except (EngineDeadError, RequestCut) as e:
            queue.put_nowait((run, e))

    tasks = [asyncio.ensure_future(pump(run)) for run in runs]
    for task in tasks:
        task.add_done_callback(_retrieve)
    open_runs = set(range(len(runs)))
    try:
        while open_runs:
            run, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            # The state is live: read now, a finished one is complete whichever item it is.
            done = item.finished
            yield run, item
            if done:
                open_runs.discard(run.prompt_index)
    finally:
        for task in tasks:
            task.cancel()


@dataclass
class _Shape:
    """What every chunk of one response shares."""

    request_id: str
    created: int
    model: str
    params: SamplingParams
    include_usage: bool
    chat: bool
    tools: ToolPlan | None = None
    called: set[int] = field(default_factory=set)  # choices whose named call has begun
    echo: list[tuple[str, list[int], int]] | None = None  # per prompt, with `echo`: _echo()
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs asked for: how many top ones
    # Under --reasoning-parser: each chat choice's reasoning / content split, by choice index.
    reasoning: dict[int, ChoiceReasoning] | None = None

    @property
    def text_only(self) -> bool:
        """Chunks carry text alone (no logprobs, echo, prompt logprobs or tool calls): they can
        come from byte templates (responses.TextChunks)."""
        return (
            self.params.logprobs is None
            and (self.tools is None or self.tools.mode == "none")
            and self.echo is None
            and self.prompt_logprobs is None
            and self.reasoning is None
        )

    def body(self, choices: list[dict], usage: dict | None) -> dict:
        return R.completion_body(
            self.request_id, self.created, self.model, choices, usage, chunk=True, chat=self.chat
        )

"""One API request in flight: a `Run` per prompt (its engine stream and timings), the `_Shape`
every chunk of its response shares, and `RequestCut`, how a shutdown ends it."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from atom_runtime.engine.core_client import RequestStream
from atom_runtime.output_processor import RequestOutput
from atom_runtime.sampling_params import SamplingParams
from atom_runtime.server import responses as R
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
    """One prompt of an API request, as submitted to the engine (its n choices together)."""

    request_id: str
    api_request_id: str  # the HTTP request's id (request_id is it, or it + "-<prompt index>")
    prompt_index: int
    stream: RequestStream
    num_prompt_tokens: int
    arrival: float  # time.monotonic() when the HTTP request arrived
    arrival_wall: float  # time.time() then, to compare with the engine's timestamps
    first_token_at: float | None = None
    last: RequestOutput | None = None

    async def next(self) -> RequestOutput:
        out = await self.stream.get()
        if self.first_token_at is None and any(c.token_ids for c in out.outputs):
            self.first_token_at = time.monotonic()
        self.last = out
        return out

    async def final(self) -> RequestOutput:
        while self.last is None or not self.last.finished:
            await self.next()
        return self.last

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finished

    @property
    def num_output_tokens(self) -> int:
        return 0 if self.last is None else sum(len(c.token_ids) for c in self.last.outputs)


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

    def body(self, choices: list[dict], usage: dict | None) -> dict:
        return R.completion_body(
            self.request_id, self.created, self.model, choices, usage, chunk=True, chat=self.chat
        )

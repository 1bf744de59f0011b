"""The HTTP side of one generation request: the body parsed strictly, the answer sent as JSON or
as an SSE stream, and the client's disconnect watched for."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

import msgspec
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from atom_runtime.web.errors import from_validation_error

_json = msgspec.json.Encoder()


def parse_body(model: type[BaseModel], body: bytes) -> BaseModel:
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise from_validation_error(e) from None


def json_response(body: dict, status: int = 200) -> Response:
    return Response(_json.encode(body), status_code=status, media_type="application/json")


class ClientGone(Exception):
    """The HTTP client disconnected before its response was ready."""


# Request ids come from the OS's CSPRNG (unpredictable: Python's Mersenne Twister is predictable
# from 156 consecutive ids), drawn 256 ids at a time: uuid4 (a getrandom call and UUID's field
# checks per id) cost 4% of the API server's CPU per one-token request on the CPU box; a batch
# makes an id cheaper than Mersenne Twister's. A forked child starts with a fresh batch.
_IDS_PER_DRAW = 256
_ids: list[str] = []
os.register_at_fork(after_in_child=_ids.clear)


def random_id() -> str:
    """32 random hex digits, as `uuid.uuid4().hex` gives (vLLM's request ids)."""
    try:
        return _ids.pop()
    except IndexError:
        pool = os.urandom(16 * _IDS_PER_DRAW)
        _ids.extend(pool[i : i + 16].hex() for i in range(16, len(pool), 16))
        return pool[:16].hex()


class EventStream(StreamingResponse):
    """An SSE response from an async iterator of encoded events. Starlette's StreamingResponse
    watches for the client's disconnect through an anyio task group whose cancellation formats
    task reprs: about 8% of the API server's CPU per one-token streaming request on the CPU box
    (py-spy, `benchmarks/serve_cpu_cost.py --tiny --output-len 1`). Here two plain asyncio
    tasks, the stream and the watch: whichever ends first cancels the other, so a client that
    goes away stops the iterator (whose request is then aborted)."""

    async def __call__(self, scope, receive, send) -> None:
        stream = asyncio.ensure_future(self.stream_response(send))
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait((stream, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not stream.done():
                stream.cancel()
                # The iterator's cleanup (the abort) runs before the response ends.
                await asyncio.wait((stream,))
        if not stream.cancelled():
            stream.result()  # what the stream raised, if anything
        if self.background is not None:
            await self.background()


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _sse(chunks: AsyncIterator[bytes]) -> StreamingResponse:
    return EventStream(
        chunks,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def wait_disconnect(request: Request) -> None:
    """Return once the HTTP client has gone. Read the body first: this takes every later message
    of the request's receive channel."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return

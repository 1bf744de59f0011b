"""The HTTP side of one generation request: the body parsed strictly, the answer sent as JSON or
as an SSE stream, and the client's disconnect watched for."""

from __future__ import annotations

from collections.abc import AsyncIterator

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from atom_runtime.server import responses as R
from atom_runtime.server.errors import from_validation_error


def parse_body(model: type[BaseModel], body: bytes) -> BaseModel:
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise from_validation_error(e) from None


def json_response(body: dict, status: int = 200) -> Response:
    return Response(R.encode(body), status_code=status, media_type="application/json")


class ClientGone(Exception):
    """The HTTP client disconnected before its response was ready."""


def _sse(chunks: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(
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

"""ASGI middleware that refuses an oversized request body before anything reads it (413), and
(optionally) one that does not arrive in time (408)."""

from __future__ import annotations

import asyncio
import time

from atom_runtime.web.errors import APIError
from atom_runtime.web.request_io import json_response


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is answered 413 before it is parsed
    (at once when Content-Length says so, else as soon as the streamed body passes the limit),
    so one request cannot make the server buffer and tokenize megabytes it will refuse anyway.
    With `read_timeout`, a body not whole within that many seconds of its headers is answered
    408: a client that trickles its body cannot hold a connection and its buffer for ever.

    A refused body is not read into memory either way. With `drain_limit`, one whose
    Content-Length is at most that is read and discarded after the 413 (the server's HTTP layer
    does it), as nginx's lingering close: a client still sending it then reads the 413 instead
    of a connection reset, which a proxy in front would take for a dead server. Bigger ones, and
    all of them without `drain_limit`, are cut off with the connection."""

    def __init__(
        self,
        app,
        limit: int,
        read_timeout: float | None = None,
        drain_limit: int | None = None,
    ) -> None:
        self.app = app
        self.limit = limit
        self.read_timeout = read_timeout
        self.drain_limit = drain_limit

    def _error(self) -> APIError:
        return APIError(
            413,
            f"request body: larger than the server's limit of {self.limit} bytes "
            "(--max-request-body-bytes)",
            "invalid_request_error",
            None,
            "request_too_large",
        )

    def _late(self) -> APIError:
        return APIError(
            408,
            f"request body: not received within {self.read_timeout:g} s",
            "invalid_request_error",
            None,
            "request_timeout",
        )

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                response = json_response(self._error().body(), 413)
                if self.drain_limit is None or int(value) > self.drain_limit:
                    response.headers["connection"] = "close"  # the unread body is not drained
                return await response(scope, receive, send)
        received = 0
        whole = False
        deadline = None if self.read_timeout is None else time.monotonic() + self.read_timeout

        async def limited_receive():
            nonlocal received, whole
            if deadline is None or whole:
                message = await receive()
            else:
                try:
                    message = await asyncio.wait_for(receive(), deadline - time.monotonic())
                except TimeoutError:
                    raise self._late() from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                whole = not message.get("more_body", False)
                if received > self.limit:
                    raise self._error()  # the app's APIError handler answers the 413
            return message

        await self.app(scope, limited_receive, send)

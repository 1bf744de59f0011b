"""ASGI middleware that refuses an oversized request body before anything reads it (413)."""

from __future__ import annotations

from atom_runtime.web.errors import APIError
from atom_runtime.web.request_io import json_response


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is answered 413 before it is parsed
    (at once when Content-Length says so, else as soon as the streamed body passes the limit),
    so one request cannot make the server buffer and tokenize megabytes it will refuse anyway."""

    def __init__(self, app, limit: int) -> None:
        self.app = app
        self.limit = limit

    def _error(self) -> APIError:
        return APIError(
            413,
            f"request body: larger than the server's limit of {self.limit} bytes "
            "(--max-request-body-bytes)",
            "invalid_request_error",
            None,
            "request_too_large",
        )

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                response = json_response(self._error().body(), 413)
                response.headers["connection"] = "close"  # the unread body is not drained
                return await response(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise self._error()  # the app's APIError handler answers the 413
            return message

        await self.app(scope, limited_receive, send)

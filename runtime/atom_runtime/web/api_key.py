"""API keys: `Authorization: Bearer <key>`, compared in constant time; and the ASGI middleware
that puts every route of an app but a few open ones behind one."""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from atom_runtime.web.errors import invalid_api_key
from atom_runtime.web.request_io import json_response


def bearer_matches(authorization: str | None, key: str) -> bool:
    """Whether an Authorization header carries `key` as its bearer token."""
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


class APIKeyGuard:
    """ASGI middleware: an HTTP request to any path but `open_paths` without the key is answered
    401 (an OpenAI error body) before the app sees it, unknown paths and docs included, and its
    connection closed (its body is never read, not even to be dropped)."""

    def __init__(self, app, key: str, open_paths: Iterable[str] = ("/health",)) -> None:
        self.app = app
        self.key = key
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            authorization = next(
                (v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None
            )
            if not bearer_matches(authorization, self.key):
                response = json_response(invalid_api_key().body(), 401)
                response.headers["connection"] = "close"  # no body of a stranger's is read
                return await response(scope, receive, send)
        await self.app(scope, receive, send)

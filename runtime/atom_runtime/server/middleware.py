"""The API server's ASGI middleware and its last-resort answers: the generation fast path around
FastAPI's router, a client gone (499), an unexpected error (500 with an OpenAI-style body)."""

from __future__ import annotations

import logging

from starlette.requests import Request
from starlette.responses import Response

from atom_runtime.server.state import ServerState
from atom_runtime.web.errors import APIError, error_body
from atom_runtime.web.request_io import ClientGone, json_response

log = logging.getLogger("atom_runtime.server")


def client_gone_response() -> Response:
    return Response(status_code=499)  # nobody is listening; nginx's code for the log


def unexpected_error_response(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return json_response(
        error_body(f"internal error: {type(exc).__name__}", "internal_server_error"), 500
    )


class GenerationFastPath:
    """ASGI middleware: POST /v1/completions and /v1/chat/completions go straight to their
    handlers, around FastAPI's router, its dependency solving and its exception middleware
    (their routes stay registered, for the OpenAPI schema and every other method). The same
    key check, the same handlers, the same error answers as the app's exception handlers. On
    the CPU box FastAPI's layers were about a tenth of the API server's CPU per one-token
    streaming request (py-spy, `benchmarks/serve_cpu_cost.py --tiny --output-len 1`); at
    W1's admission burst that CPU is what delays the streams already running."""

    ROUTES = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}  # handler names

    def __init__(self, app, state: ServerState, check_key) -> None:
        self.app = app
        self.state = state
        self.check_key = check_key

    async def __call__(self, scope, receive, send) -> None:
        name = self.ROUTES.get(scope["path"]) if scope["type"] == "http" else None
        if name is None or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        request = Request(scope, receive, send)
        try:
            await self.check_key(request)
            response = await getattr(self.state.require_serving(), name)(request)
        except APIError as exc:
            response = json_response(exc.body(), exc.status)
        except ClientGone:
            response = client_gone_response()
        except Exception as exc:
            response = unexpected_error_response(request, exc)
        await response(scope, receive, send)

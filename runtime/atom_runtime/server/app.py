"""`build_app`: the API server's FastAPI app. The engine loads in the lifespan (the routes answer
503 until it is ready); with --api-key every route that serves the model or reads what it was
sent needs the key (/v1/*, tokenize, detokenize, debug), while /health, /metrics and /version
stay open for probes and scrapers, as in vLLM (docs/serving.md). With --allowed-origins, CORS
headers for those origins (none by default)."""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

import atom_runtime
from atom_runtime.server import openapi as D
from atom_runtime.server.middleware import (
    GenerationFastPath,
    client_gone_response,
    unexpected_error_response,
)
from atom_runtime.server.routes.debug import debug_routes
from atom_runtime.server.routes.openai import openai_routes
from atom_runtime.server.routes.probes import probe_routes
from atom_runtime.server.routes.tokens import token_routes
from atom_runtime.server.state import ServerState
from atom_runtime.system.process import release_gc_policy
from atom_runtime.web.api_key import bearer_matches
from atom_runtime.web.body_limit import BodyLimit
from atom_runtime.web.errors import APIError, error_body, invalid_api_key
from atom_runtime.web.request_io import ClientGone, json_response

# An oversized body up to this size is read and dropped after its 413, so the router in front
# (whose own limit may be larger) reads the 413 rather than a reset connection, which it would
# take for a dead pod. Bigger ones are cut off.
DRAIN_BYTES = 64 << 20


def build_app(state: ServerState) -> FastAPI:
    app = D.make_app(title="ATOM", version=atom_runtime.__version__, lifespan=_lifespan(state))

    async def require_api_key(request: Request) -> None:
        key = state.config.api_key
        if key is None:
            return
        if not bearer_matches(request.headers.get("authorization"), key):
            raise invalid_api_key()

    # Added first, so it runs inside BodyLimit (which reads the body for it).
    app.add_middleware(GenerationFastPath, state=state, check_key=require_api_key)
    app.add_middleware(
        BodyLimit, limit=state.config.max_request_body_bytes, drain_limit=DRAIN_BYTES
    )
    c = state.config
    if c.allowed_origins:  # outermost: preflight OPTIONS requests are answered here
        app.add_middleware(
            CORSMiddleware,
            allow_origins=c.allowed_origins,
            allow_methods=c.allowed_methods,
            allow_headers=c.allowed_headers,
            allow_credentials=c.allow_credentials,
        )
    keyed = [Depends(require_api_key)]
    app.include_router(openai_routes(state, keyed))
    app.include_router(probe_routes(state))
    app.include_router(token_routes(state, keyed))
    if state.config.enable_debug_endpoints:
        app.include_router(debug_routes(state, keyed))
    _add_error_handlers(app)
    return app


def _lifespan(state: ServerState):
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loader = asyncio.ensure_future(state.start_engine())
        try:
            yield
        finally:
            loader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loader
            await state.stop_background()
            await state.client.shutdown()
            if state.serving is not None:
                state.serving.close()
            release_gc_policy()

    return lifespan


def _add_error_handlers(app: FastAPI) -> None:
    """Every error ends as an OpenAI-style body: ours, FastAPI's 404/405, and the unexpected."""

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> Response:
        return json_response(exc.body(), exc.status)

    @app.exception_handler(ClientGone)
    async def on_client_gone(request: Request, exc: ClientGone) -> Response:
        return client_gone_response()

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return json_response(error_body(str(exc.detail), kind), exc.status_code)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> Response:
        return unexpected_error_response(request, exc)

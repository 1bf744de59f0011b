"""`atom router`'s FastAPI app: the OpenAI routes it routes, the ones it passes through, its own
probe, admin and metrics routes, and what guards them all.

Guards, outermost first: the API key (--api-key: every route but /health, docs and admin routes
included), the body limit (413 before a byte of an oversized body is read, 408 for a body that
does not arrive within --request-body-timeout). Header read timeouts sit below the app, in the
HTTP protocol (web/header_timeout.py). A client that leaves early costs one log line.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from atom_runtime.router.app import Router
from atom_runtime.router.config import RouterError
from atom_runtime.web.api_key import APIKeyGuard
from atom_runtime.web.body_limit import BodyLimit
from atom_runtime.web.errors import APIError
from atom_runtime.web.metrics import CONTENT_TYPE
from atom_runtime.web.request_io import json_response, wait_disconnect

log = logging.getLogger(__name__)

# Counted for a client that left before its answer began (nginx's code; nothing is sent).
CLIENT_CLOSED_REQUEST = 499
OPEN_PATHS = ("/health",)


def build_app(router: Router) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="atom router", lifespan=lifespan)
    c = router.config
    app.add_middleware(
        BodyLimit, limit=c.max_request_body_bytes, read_timeout=c.request_body_timeout
    )
    if c.api_key is not None:
        app.add_middleware(APIKeyGuard, key=c.api_key, open_paths=OPEN_PATHS)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> Response:
        return json_response(exc.body(), exc.status)

    _add_routed(app, router)
    _add_passthrough(app, router)
    _add_own(app, router)
    return app


def _add_routed(app: FastAPI, router: Router) -> None:
    async def routed(request: Request, route: str) -> Response:
        try:
            await request.body()  # read first: the watch below takes the rest of the channel
        except ClientDisconnect:
            log.info("%s: the client left before sending its whole request", route)
            router.metrics.requests.labels(route, str(CLIENT_CLOSED_REQUEST)).inc()
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        response = await _until_client_leaves(router, request, route)
        router.metrics.requests.labels(route, str(response.status_code)).inc()
        return response

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await routed(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await routed(request, "/v1/chat/completions")


async def _until_client_leaves(router: Router, request: Request, route: str) -> Response:
    """Until the first byte is relayed nothing else notices a client that leaves (a remote
    prefill, a pull, a whole non-streamed answer may be under way): watch for it, and cancel the
    work, which closes the pods' requests so that they abort too."""
    work = asyncio.ensure_future(router.handle(request, route))
    gone = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        raise
    finally:
        gone.cancel()
    if not work.done():
        work.cancel()
        await asyncio.wait((work,))
    if work.cancelled():
        log.info("%s: the client left before its answer began", route)
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    try:
        return work.result()
    except RouterError as e:
        return e.response()


def _add_passthrough(app: FastAPI, router: Router) -> None:
    async def passthrough(request: Request, method: str, path: str) -> Response:
        try:
            return await router.passthrough(request, method, path)
        except RouterError as e:
            return e.response()
        except ClientDisconnect:
            log.info("%s: the client left before sending its whole request", path)
            return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await passthrough(request, "GET", "/v1/models")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await passthrough(request, "POST", "/tokenize")

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await passthrough(request, "POST", "/detokenize")


def _add_own(app: FastAPI, router: Router) -> None:
    @app.get("/health")
    async def health() -> Response:
        # Always 200 while the process runs: with a role scaled to zero the router must stay in
        # its Service, so requests reach the queue that makes the operator scale the role up.
        ready = {role: len(router.pool.ready(role)) for role in router.pool.backends}
        return Response(
            json.dumps({"status": "ok", "ready_backends": ready}), media_type="application/json"
        )

    @app.get("/router/backends")
    async def backends() -> Response:
        return Response(json.dumps(router.describe()), media_type="application/json")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await router.metrics.render(), media_type=CONTENT_TYPE)

"""Routes for probes and scrapers, open even with --api-key (they carry no prompt or output):
/health, /version, /metrics."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.responses import Response

import atom_runtime
from atom_runtime.server import openapi as D
from atom_runtime.server.state import ServerState
from atom_runtime.web.errors import engine_unavailable
from atom_runtime.web.metrics import CONTENT_TYPE
from atom_runtime.web.request_io import json_response


def probe_routes(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.get("/health", responses=D.responses(D.HealthResponse, 503))
    async def health() -> Response:
        if state.healthy:
            return json_response({"status": "ok"})
        if state.client.dead:
            reason = state.client.death_reason
        elif state.serving is None:
            reason = "the model is still loading"
        else:
            reason = "the server is shutting down"
        return json_response(engine_unavailable(reason).body(), 503)

    @router.get("/version", responses=D.responses(D.VersionResponse))
    async def version() -> Response:
        return json_response({"version": atom_runtime.__version__})

    @router.get(
        "/metrics",
        responses={200: {"description": "Prometheus text format",
                         "content": {CONTENT_TYPE: {"schema": {"type": "string"}}}}},
    )  # fmt: skip
    async def metrics() -> Response:
        return Response(await state.metrics.render(), media_type=CONTENT_TYPE)

    return router

"""Debug routes, off unless --enable-debug-endpoints: one drops every cached prefix (a cheap way to
slow a server down), the other lists what is cached. Tests and operators switch them on
deliberately; they need the key with --api-key."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.responses import Response

from atom_runtime.server import openapi as D
from atom_runtime.server.state import ServerState
from atom_runtime.web.request_io import json_response


def debug_routes(state: ServerState, keyed: list) -> APIRouter:
    router = APIRouter(dependencies=keyed)

    @router.post("/reset_prefix_cache", responses=D.responses(D.ResetPrefixCacheResponse, 401, 503))
    async def reset_prefix_cache() -> Response:
        state.require_serving()
        return json_response({"reset": bool(await state.client.utility("reset_prefix_cache"))})

    @router.get("/debug/kv_cache", responses=D.responses(D.KVCacheResponse, 401, 503))
    async def debug_kv_cache() -> Response:
        state.require_serving()
        hashes = await state.client.utility("cached_block_hashes")
        return json_response(
            {"block_hashes": list(hashes), "num_blocks": state.client.ready.num_blocks}
        )

    return router

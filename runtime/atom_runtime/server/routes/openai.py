"""The OpenAI API under /v1: models, completions, chat completions (key required with --api-key)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from atom_runtime.server import openapi as D
from atom_runtime.server import responses as R
from atom_runtime.server.protocol import ChatCompletionRequest, CompletionRequest
from atom_runtime.server.state import ServerState
from atom_runtime.web.request_io import json_response


def openai_routes(state: ServerState, keyed: list) -> APIRouter:
    v1 = APIRouter(prefix="/v1", dependencies=keyed)

    @v1.get("/models", responses=D.responses(D.ModelList, 401, 503))
    async def models() -> Response:
        serving = state.require_serving()
        ready = state.client.ready
        # `root` is the served name, never the server's filesystem path (which says nothing
        # useful to a client and tells an attacker about the pod's layout).
        return json_response(
            R.model_list(
                serving.model_names,
                int(state.started),
                serving.model_names[0],
                ready.max_model_len,
            )  # fmt: skip
        )

    @v1.post(
        "/completions", **D.parsed_body_route(CompletionRequest, D.CompletionResponse, stream=True)
    )
    async def completions(request: Request) -> Response:
        return await state.require_serving().completions(request)

    @v1.post(
        "/chat/completions",
        **D.parsed_body_route(ChatCompletionRequest, D.ChatCompletionResponse, stream=True),
    )
    async def chat_completions(request: Request) -> Response:
        return await state.require_serving().chat(request)

    return v1

"""vLLM's /tokenize and /detokenize (key required with --api-key)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from atom_runtime.server import openapi as D
from atom_runtime.server.protocol import DetokenizeRequest, TokenizeRequest
from atom_runtime.server.state import ServerState
from atom_runtime.web.errors import bad_request
from atom_runtime.web.request_io import json_response, parse_body


def token_routes(state: ServerState, keyed: list) -> APIRouter:
    router = APIRouter(dependencies=keyed)

    @router.post("/tokenize", **D.parsed_body_route(TokenizeRequest, D.TokenizeResponse))
    async def tokenize(request: Request) -> Response:
        serving, req = await _serving_request(state, request, TokenizeRequest)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("prompt: give exactly one of prompt or messages", "prompt")
        if req.prompt is not None:
            ids = await serving.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            try:
                ids = await serving.encode_chat(
                    [m.template_dict() for m in req.messages],
                    add_generation_prompt=req.add_generation_prompt,
                )
            except ValueError as e:
                raise bad_request(str(e), "messages") from None
        return json_response(
            {"count": len(ids), "max_model_len": state.client.ready.max_model_len, "tokens": ids}
        )

    @router.post("/detokenize", **D.parsed_body_route(DetokenizeRequest, D.DetokenizeResponse))
    async def detokenize(request: Request) -> Response:
        serving, req = await _serving_request(state, request, DetokenizeRequest)
        vocab = state.client.ready.vocab_size
        for i, t in enumerate(req.tokens):
            if not 0 <= t < vocab:
                raise bad_request(
                    f"tokens[{i}]: token id {t} is outside the vocabulary [0, {vocab})",
                    f"tokens[{i}]",
                )
        return json_response({"prompt": await serving.decode(req.tokens)})

    return router


async def _serving_request(state: ServerState, request: Request, kind: type):
    """The serving side and the request's body parsed as `kind`, its model checked (503 before
    the engine is ready, 400 or 404 naming the problem)."""
    serving = state.require_serving()
    req = parse_body(kind, await request.body())
    serving.check_model(req.model)
    return serving, req

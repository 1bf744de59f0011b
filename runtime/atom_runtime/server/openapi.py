"""The published API description: `/openapi.json` with a typed schema for every request and
response, and `/docs` (Swagger UI) and `/redoc` served from fastapi-offline's bundled assets, so
they work with no internet access (FastAPI's own pages load them from a CDN).

The routes parse their bodies themselves (strict pydantic models in protocol.py, with errors that
name the field), so FastAPI never sees a body parameter and would publish `{}` for each. Here the
same request models give the request schemas; the response models below exist only to describe
what responses.py builds, and are never used to serialize a response.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi_offline import FastAPIOffline
from pydantic import BaseModel, ConfigDict

DOCS_ASSETS = "/docs-assets"


class _Doc(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(_Doc):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Doc):
    """Every refusal: 400 (a field, named in `param`), 401, 404, 413, 503."""

    error: ErrorDetail


class PromptTokensDetails(_Doc):
    cached_tokens: int


class Usage(_Doc):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(_Doc):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Doc):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length", "abort"] | None
    stop_reason: int | str | None
    prompt_logprobs: list[dict[str, Any] | None] | None = None


class CompletionResponse(_Doc):
    """A completion; with `stream: true`, `text/event-stream` of `data: <chunk>` events of this
    shape (`usage` null but in the last one when asked for), then `data: [DONE]`."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None
    kv_transfer_params: dict[str, Any] | None = None


class ToolCallFunction(_Doc):
    name: str
    arguments: str


class ToolCall(_Doc):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class AssistantMessage(_Doc):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None


class TopLogprob(_Doc):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Doc):
    content: list[ChatTokenLogprob]


class ChatChoice(_Doc):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None
    stop_reason: int | str | None


class ChatCompletionResponse(_Doc):
    """A chat completion; with `stream: true`, `text/event-stream` of `chat.completion.chunk`
    events (each choice a `delta` instead of a `message`), then `data: [DONE]`."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None
    kv_transfer_params: dict[str, Any] | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None


class ModelCard(_Doc):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int


class ModelList(_Doc):
    object: Literal["list"]
    data: list[ModelCard]


class HealthResponse(_Doc):
    status: Literal["ok"]


class VersionResponse(_Doc):
    version: str


class TokenizeResponse(_Doc):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(_Doc):
    prompt: str


class ResetPrefixCacheResponse(_Doc):
    reset: bool


class KVCacheResponse(_Doc):
    block_hashes: list[int]
    num_blocks: int


# One server-sent event of a stream (the schema applies to each event, as OpenAPI 3.2's
# `itemSchema` and schemathesis read it): `data` holds a JSON chunk, or `[DONE]` last.
SSE_EVENT = {
    "type": "object",
    "properties": {"data": {"type": "string", "description": "a JSON chunk, or [DONE]"}},
    "required": ["data"],
}


def responses(ok: type[BaseModel] | None, *errors: int, stream: bool = False) -> dict:
    """FastAPI's `responses=` for a route: its 200 model and the error statuses it can give."""
    out: dict[int | str, dict] = {}
    if ok is not None:
        out[200] = {"model": ok, "description": (ok.__doc__ or ok.__name__).split("\n")[0]}
        if stream:
            out[200]["content"] = {"text/event-stream": {"schema": SSE_EVENT}}
    reasons = {
        400: "a bad request; `param` names the field",
        401: "a missing or wrong API key",
        404: "an unknown model",
        413: "a body over --max-request-body-bytes",
        503: "the model is loading, the engine died, or the server is shutting down",
    }
    for status in errors:
        out[status] = {"model": ErrorResponse, "description": reasons[status]}
    return out


# Request models documented with `request_body`, by schema name: make_app's openapi() adds their
# schemas to the components.
_BODIES: dict[str, type[BaseModel]] = {}


def parsed_body_route(
    body: type[BaseModel], ok: type[BaseModel], stream: bool = False
) -> dict[str, dict]:
    """The OpenAPI keywords of a POST route that parses `body` itself and answers `ok`: bad
    input, a wrong key, an unknown model, a body too large, and the engine not serving."""
    return {
        "openapi_extra": request_body(body),
        "responses": responses(ok, 400, 401, 404, 413, 503, stream=stream),
    }


def request_body(model: type[BaseModel]) -> dict:
    """`openapi_extra=` that documents a body the route parses itself."""
    _BODIES[model.__name__] = model
    return {
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}
            },
        },
    }


def make_app(**kwargs: Any) -> FastAPI:
    """A FastAPI app whose /docs and /redoc load their scripts from this server, and whose
    /openapi.json carries the typed schemas (see `request_body`)."""
    app = FastAPIOffline(static_url=DOCS_ASSETS, **kwargs)

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(
            title=app.title,
            version=app.version,
            description="OpenAI-compatible API of the ATOM engine (docs/serving.md).",
            routes=app.routes,
        )
        for operations in schema["paths"].values():
            for op in operations.values():
                for response in op["responses"].values():
                    # FastAPI adds an untyped application/json entry beside a route's own
                    # (/metrics' text): drop it where a typed one exists.
                    content = response.get("content", {})
                    if len(content) > 1 and content.get("application/json") == {"schema": {}}:
                        del content["application/json"]
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in _BODIES.values():
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
    return app

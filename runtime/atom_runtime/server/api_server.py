"""The API server process: FastAPI on uvicorn in front of an EngineCore process.

Lifecycle, in order:
1. `serve` titles the process, binds the port (a busy port fails at once) and starts uvicorn;
   `/health` answers 503 while the engine core loads in the background.
2. The engine core says Ready; the tokenizer loads; the GC policy is applied; `/health` is 200.
3. SIGTERM/SIGINT: uvicorn stops accepting, in-flight requests get `--shutdown-grace-period`
   seconds to finish; those still running then are cut cleanly (a 503 with an error body, or a
   final SSE error event and `[DONE]`; aborted in the engine; one log line says how many), the
   engine core is stopped, the GC unfrozen, and the process exits 0.
4. If the engine core dies: in-flight requests fail with 503, `/health` turns 503, and the server
   exits 1 after $ATOM_ENGINE_DEATH_EXIT_DELAY_S (default 1 s: long enough for a probe to see
   the 503; a test raises it to look at the 503 at leisure).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import signal
import socket
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

import atom_runtime
from atom_runtime.config import EngineConfig
from atom_runtime.engine.core_client import EngineCoreClient, EngineStartupError
from atom_runtime.engine.output_processor import OutputProcessor
from atom_runtime.server import openapi as D
from atom_runtime.server import responses as R
from atom_runtime.server.metrics import CONTENT_TYPE, ServerMetrics
from atom_runtime.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from atom_runtime.server.serving import OpenAIServing
from atom_runtime.system.process import apply_gc_policy, release_gc_policy, set_process_title
from atom_runtime.text.tokenizer import Tokenizer
from atom_runtime.web.errors import (
    APIError,
    bad_request,
    engine_unavailable,
    error_body,
    invalid_api_key,
)
from atom_runtime.web.request_io import ClientGone, json_response, parse_body

log = logging.getLogger("atom_runtime.server")

ENGINE_DEATH_EXIT_DELAY_ENV = "ATOM_ENGINE_DEATH_EXIT_DELAY_S"
# After the grace period's cut, how long the cut responses get to be written out before uvicorn
# cancels what is left (a last resort: the cut ends every request the server knows of).
CUT_DRAIN_S = 10.0


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    log_level: str = "info"
    log_requests: bool = True
    shutdown_grace_period: float = 10.0
    engine_stall_timeout: float = 300.0
    tool_call_parser: str | None = None  # set with --enable-auto-tool-choice: tool_choice "auto"
    max_request_body_bytes: int = 8 * 1024 * 1024
    max_sequences_per_request: int = 256
    enable_debug_endpoints: bool = False  # /debug/kv_cache and POST /reset_prefix_cache


class ServerState:
    """Everything the routes read: the engine client, and the serving layer once ready."""

    def __init__(self, config: ServerConfig, engine_config: EngineConfig) -> None:
        self.config = config
        self.engine_config = engine_config
        self.client = EngineCoreClient(engine_config, config.log_level, config.engine_stall_timeout)
        self.metrics = ServerMetrics(lambda: self.client.stats)
        self.serving: OpenAIServing | None = None
        self.server: uvicorn.Server | None = None
        self.exit_code = 0
        self.started = time.time()
        self.model_names = [config.served_model_name or engine_config.served_model_name or
                            engine_config.model or _default_model_name()]  # fmt: skip

    @property
    def healthy(self) -> bool:
        return self.serving is not None and not self.client.dead and not self._stopping

    @property
    def _stopping(self) -> bool:
        return self.server is not None and self.server.should_exit

    def require_serving(self) -> OpenAIServing:
        if self.client.dead:
            raise engine_unavailable("the engine core died; the server is exiting")
        if self.serving is None:
            raise engine_unavailable("the model is still loading")
        return self.serving

    def exit(self, code: int) -> None:
        self.exit_code = code
        if self.server is not None:
            self.server.should_exit = True

    async def start_engine(self) -> None:
        """Warm-up: load the engine core and the tokenizer, then apply the GC policy."""
        try:
            ready = await self.client.start()
            tokenizer = await asyncio.to_thread(
                Tokenizer.from_path, Path(ready.model_path), ready.eos_token_ids
            )
        except (EngineStartupError, OSError, ValueError) as e:
            log.error("atom serve: the engine failed to start: %s", e)
            self.exit(1)
            return
        self.client.attach_processor(OutputProcessor(tokenizer))
        self.client.on_death = self.on_engine_death
        self.serving = OpenAIServing(
            self.client,
            tokenizer,
            self.model_names,
            self.metrics,
            self.config.log_requests,
            self.config.tool_call_parser,
            self.config.max_sequences_per_request,
        )
        apply_gc_policy()
        c = self.config
        log.info(
            "serving %s (%s) on %s: %d KV blocks of %d tokens, max_model_len %d, "
            "up to %d tokens a step",
            self.model_names[0],
            ready.model_path,
            ready.device,
            ready.num_blocks,
            ready.block_size,
            ready.max_model_len,
            ready.max_num_batched_tokens,
        )
        log.info("OpenAI-compatible API ready at http://%s:%d/v1", c.host, c.port)

    def cut_in_flight(self) -> None:
        """The shutdown grace period is over: end the requests still running, cleanly."""
        if self.serving is None:
            return
        grace = self.config.shutdown_grace_period
        cut = self.serving.cut_in_flight(
            f"the server is shutting down and the request did not finish within the "
            f"{grace:g} s shutdown grace period"
        )
        if cut:
            log.warning(
                "shutdown grace period (%g s) over: %d request(s) still running were cut off "
                "(503 / SSE error event)",
                grace,
                cut,
            )

    def on_engine_death(self) -> None:
        self.exit_code = 1
        delay = float(os.environ.get(ENGINE_DEATH_EXIT_DELAY_ENV, "1"))
        asyncio.get_running_loop().call_later(delay, self.exit, 1)


def _default_model_name() -> str:
    from atom_runtime.models.loader import DEFAULT_MODEL

    return DEFAULT_MODEL


def build_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loader = asyncio.ensure_future(state.start_engine())
        try:
            yield
        finally:
            loader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loader
            await state.client.shutdown()
            if state.serving is not None:
                state.serving.close()
            release_gc_policy()

    app = D.make_app(title="ATOM", version=atom_runtime.__version__, lifespan=lifespan)

    async def require_api_key(request: Request) -> None:
        key = state.config.api_key
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), key.encode()
        ):
            raise invalid_api_key()

    # Added first, so it runs inside BodyLimit (which reads the body for it).
    app.add_middleware(GenerationFastPath, state=state, check_key=require_api_key)
    app.add_middleware(BodyLimit, limit=state.config.max_request_body_bytes)

    # With --api-key: every route that serves the model or reads what it was sent needs the key
    # (/v1/*, tokenize, detokenize, debug and reset). /health, /metrics and /version stay open for
    # probes and scrapers (as in vLLM); they carry no prompt or output. See docs/serving.md.
    keyed = [Depends(require_api_key)]
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
        "/completions",
        openapi_extra=D.request_body(CompletionRequest),
        responses=D.responses(D.CompletionResponse, 400, 401, 404, 413, 503, stream=True),
    )
    async def completions(request: Request) -> Response:
        return await state.require_serving().completions(request)

    @v1.post(
        "/chat/completions",
        openapi_extra=D.request_body(ChatCompletionRequest),
        responses=D.responses(D.ChatCompletionResponse, 400, 401, 404, 413, 503, stream=True),
    )
    async def chat_completions(request: Request) -> Response:
        return await state.require_serving().chat(request)

    app.include_router(v1)

    @app.get("/health", responses=D.responses(D.HealthResponse, 503))
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

    @app.get("/version", responses=D.responses(D.VersionResponse))
    async def version() -> Response:
        return json_response({"version": atom_runtime.__version__})

    @app.get(
        "/metrics",
        responses={200: {"description": "Prometheus text format",
                         "content": {CONTENT_TYPE: {"schema": {"type": "string"}}}}},
    )  # fmt: skip
    async def metrics() -> Response:
        return Response(await state.metrics.render(), media_type=CONTENT_TYPE)

    @app.post(
        "/tokenize",
        dependencies=keyed,
        openapi_extra=D.request_body(TokenizeRequest),
        responses=D.responses(D.TokenizeResponse, 400, 401, 404, 413, 503),
    )
    async def tokenize(request: Request) -> Response:
        serving = state.require_serving()
        req: TokenizeRequest = parse_body(TokenizeRequest, await request.body())
        serving.check_model(req.model)
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

    @app.post(
        "/detokenize",
        dependencies=keyed,
        openapi_extra=D.request_body(DetokenizeRequest),
        responses=D.responses(D.DetokenizeResponse, 400, 401, 404, 413, 503),
    )
    async def detokenize(request: Request) -> Response:
        serving = state.require_serving()
        req: DetokenizeRequest = parse_body(DetokenizeRequest, await request.body())
        serving.check_model(req.model)
        vocab = state.client.ready.vocab_size
        for i, t in enumerate(req.tokens):
            if not 0 <= t < vocab:
                raise bad_request(
                    f"tokens[{i}]: token id {t} is outside the vocabulary [0, {vocab})",
                    f"tokens[{i}]",
                )
        return json_response({"prompt": await serving.decode(req.tokens)})

    if state.config.enable_debug_endpoints:
        # Off by default: one drops every cached prefix (a cheap way to slow a server down), the
        # other lists what is cached. Tests and operators switch them on deliberately.
        @app.post(
            "/reset_prefix_cache",
            dependencies=keyed,
            responses=D.responses(D.ResetPrefixCacheResponse, 401, 503),
        )
        async def reset_prefix_cache() -> Response:
            state.require_serving()
            return json_response({"reset": bool(await state.client.utility("reset_prefix_cache"))})

        @app.get(
            "/debug/kv_cache",
            dependencies=keyed,
            responses=D.responses(D.KVCacheResponse, 401, 503),
        )
        async def debug_kv_cache() -> Response:
            state.require_serving()
            hashes = await state.client.utility("cached_block_hashes")
            return json_response(
                {"block_hashes": list(hashes), "num_blocks": state.client.ready.num_blocks}
            )

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

    return app


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


def run_event_loop(main: Coroutine[Any, Any, int]) -> int:
    """Run the server on uvloop when it is installed, else on asyncio's own loop. uvloop's
    socket writes and task wake-ups cost less, and they are most of a stream's work here
    (docs/serving.md, "The output path")."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


async def serve(config: ServerConfig, engine_config: EngineConfig) -> int:
    """Run `atom serve` until SIGTERM/SIGINT or engine death; returns the exit code."""
    set_process_title("APIServer")
    sock = socket.socket(socket.AF_INET6 if ":" in config.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((config.host, config.port))
    except OSError as e:
        log.error("atom serve: cannot listen on %s:%d: %s", config.host, config.port, e)
        sock.close()
        return 2
    state = ServerState(config, engine_config)
    app = build_app(state)
    server = _Server(
        uvicorn.Config(
            app,
            log_level=config.log_level,
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=config.shutdown_grace_period + CUT_DRAIN_S,
            lifespan="on",
        ),
        state,
    )
    state.server = server
    # uvicorn re-raises the signal that stopped it once it is done; catch it here so a SIGTERM
    # ends in a clean exit code instead of the default action.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _note_signal)
    await server.serve(sockets=[sock])
    return state.exit_code


class _Server(uvicorn.Server):
    """uvicorn whose graceful shutdown ends with a clean cut: when the grace period is over, the
    requests still running are answered (503, or an SSE error event and [DONE]) instead of
    being cancelled mid-write by uvicorn, which would leave clients a truncated stream and the
    log a CancelledError traceback."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        grace = self.state.config.shutdown_grace_period
        timer = asyncio.get_running_loop().call_later(grace, self.state.cut_in_flight)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def _note_signal(signum: int, frame: object) -> None:
    log.info("%s handled; exiting", signal.Signals(signum).name)

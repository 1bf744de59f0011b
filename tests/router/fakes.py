"""Engine look-alikes for the router's tests: real HTTP on 127.0.0.1 from a thread of the test,
with failures on cue."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from atom_runtime.server.app import DRAIN_BYTES
from atom_runtime.web.body_limit import BodyLimit
from atom_runtime.web.errors import APIError
from tests.server.conftest import free_port


async def _api_error(request: Request, exc: APIError) -> Response:
    return JSONResponse(exc.body(), status_code=exc.status)


METRICS = (
    "atom:requests_running 0\natom:requests_waiting 0\natom:kv_cache_usage_ratio 0\n"
    'atom:cache_config_info{block_size="16",num_gpu_blocks="256"} 1\n'
)
TOKENS = [11, 12, 13, 14, 15]


class FakeEngine:
    """Healthy and idle by its /health and /metrics; answers completions as `mode` says:
    ok (a completion naming this pod), unavailable (503), cut (one SSE event, then the
    connection drops), hold (no answer until the client leaves). /tokenize wants `key`.
    `body_limit`: bodies over it are refused as `atom serve` refuses them (web/body_limit.py,
    reading and dropping up to `drain_limit` bytes of them).
    `loading`: /health answers 503 until cleared. `bodies` keeps what each completion got."""

    def __init__(
        self,
        mode: str,
        key: str | None = None,
        body_limit: int | None = None,
        drain_limit: int | None = DRAIN_BYTES,
    ) -> None:
        self.mode, self.key = mode, key
        self.completions = 0
        self.health_probes = 0
        self.loading = threading.Event()
        self.bodies: list[dict] = []
        self.answer_extra: dict = {}  # merged into non-streamed answers
        self.disconnected = threading.Event()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        app = Starlette(
            routes=[
                Route("/health", self._health, methods=["GET"]),
                Route("/metrics", lambda r: PlainTextResponse(METRICS), methods=["GET"]),
                Route("/tokenize", self._tokenize, methods=["POST"]),
                Route("/detokenize", lambda r: JSONResponse({"prompt": "x"}), methods=["POST"]),
                Route("/v1/models", lambda r: JSONResponse({"data": []}), methods=["GET"]),
                Route("/v1/completions", self._complete, methods=["POST"]),
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
            ]
        )
        if body_limit is not None:
            app.add_middleware(BodyLimit, limit=body_limit, drain_limit=drain_limit)
            app.add_exception_handler(APIError, _api_error)
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="critical", lifespan="off"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "fake engine did not start"
            time.sleep(0.02)

    async def _health(self, request: Request) -> Response:
        self.health_probes += 1
        return Response(status_code=503 if self.loading.is_set() else 200)

    async def _tokenize(self, request: Request) -> Response:
        if self.key is not None and request.headers.get("authorization") != f"Bearer {self.key}":
            return JSONResponse({"error": {"message": "bad key"}}, status_code=401)
        return JSONResponse({"tokens": TOKENS, "count": len(TOKENS)})

    async def _complete(self, request: Request) -> Response:
        body = await request.json()
        self.bodies.append(body)
        self.completions += 1
        if self.mode == "unavailable":
            return JSONResponse({"error": {"message": "loading"}}, status_code=503)
        if self.mode == "hold":
            while (await request.receive())["type"] != "http.disconnect":
                pass
            self.disconnected.set()
            return Response(status_code=499)
        event = {"choices": [{"index": 0, "text": f"from {self.port}"}]}
        if self.mode == "ok" and not body.get("stream"):
            return JSONResponse({**event, **self.answer_extra})

        async def events():
            yield f"data: {json.dumps(event)}\n\n".encode()
            if self.mode == "cut":
                await asyncio.sleep(0.2)
                raise ConnectionResetError("the pod died mid-stream")
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def _chat(self, request: Request) -> Response:
        """A streamed chat answer as `atom serve` sends one: the role event at once, then the
        content (the cut pod dies between the two, as in a prefill or a KV pull)."""
        self.completions += 1
        role = {
            "choices": [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
            "usage": None,
        }
        text = {"choices": [{"index": 0, "delta": {"content": f"from {self.port}"},
                             "logprobs": None, "finish_reason": "stop"}], "usage": None}  # fmt: skip

        async def events():
            yield f"data: {json.dumps(role)}\n\n".encode()
            await asyncio.sleep(0.2)
            if self.mode == "cut":
                raise ConnectionResetError("the pod died during the prefill")
            yield f"data: {json.dumps(text)}\n\ndata: [DONE]\n\n".encode()

        return StreamingResponse(events(), media_type="text/event-stream")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)

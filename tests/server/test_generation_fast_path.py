"""The generation endpoints' fast path (`server/middleware.GenerationFastPath`) in front of the app's
router: what it passes on, and the error answers it gives in place of the app's exception
handlers (the rest of tests/server runs every request of those two endpoints through it on a real
server: the key check, the body limit, the 503 while loading, streaming and disconnects)."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from atom_runtime.server.middleware import GenerationFastPath
from atom_runtime.web.errors import APIError


class _Serving:
    async def completions(self, request):
        raise RuntimeError("boom")

    async def chat(self, request):
        body = await request.body()
        raise APIError(400, f"bad body of {len(body)} bytes", "invalid_request_error", None, None)


class _State:
    def require_serving(self):
        return _Serving()


def _app(check_key):
    async def fallback(request):
        return PlainTextResponse(f"app: {request.method}")

    inner = Starlette(routes=[Route("/v1/completions", fallback, methods=["GET", "POST"])])
    return GenerationFastPath(inner, _State(), check_key)


def test_errors_are_answered_like_the_app_handlers_and_other_methods_pass_on(caplog):
    async def any_key(request):
        return None

    with TestClient(_app(any_key), raise_server_exceptions=False) as client:
        r = client.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 500
        assert r.json()["error"]["type"] == "internal_server_error"
        assert "RuntimeError" in r.json()["error"]["message"]
        assert "unhandled error on POST /v1/completions" in caplog.text
        r = client.post("/v1/chat/completions", content=b"12345")
        assert r.status_code == 400 and r.json()["error"]["message"] == "bad body of 5 bytes"
        r = client.get("/v1/completions")  # not a POST: the app answers
        assert r.status_code == 200 and r.text == "app: GET"


def test_the_key_check_runs_before_the_handler():
    async def refuse(request):
        raise APIError(401, "no key", "invalid_request_error", None, "invalid_api_key")

    with TestClient(_app(refuse), raise_server_exceptions=False) as client:
        r = client.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"

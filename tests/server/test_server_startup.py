"""`atom serve`'s start-up as a user sees it: progress while loading, the phases on /metrics, the
ready line last; and the vLLM flags that shape a running server (--chat-template, CORS,
--disable-log-stats, the positional MODEL)."""

from __future__ import annotations

import re

import httpx

from tests.server.conftest import TINY_FLAGS

TEMPLATE = "FIXED-PREFIX {% for m in messages %}{{ m['content'] }}{% endfor %}"


def test_startup_phases_metrics_ready_line_chat_template_and_cors(
    tiny_models, launch_server, tmp_path
):
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    server = launch_server(
        str(tiny_models["llama"]),  # positional, as `vllm serve MODEL`
        *TINY_FLAGS,
        "--chat-template", str(template),
        "--allowed-origins", '["http://app.example"]',
        "--disable-log-stats",
    )  # fmt: skip
    metrics = httpx.get(f"{server.url}/metrics").text
    phases = dict(re.findall(r'^atom:startup_seconds\{phase="(\w+)"\} (\S+)$', metrics, re.M))
    assert {"config", "weights_read", "weights_on_device", "kv_cache", "warm_up", "tokenizer",
            "ready"} <= phases.keys()  # fmt: skip
    assert float(phases["ready"]) >= sum(float(v) for k, v in phases.items() if k != "ready")

    log = server.log().splitlines()
    ready = [i for i, line in enumerate(log) if "ready in" in line and "/v1" in line]
    assert ready, server.log()
    uvicorn_up = [i for i, line in enumerate(log) if "Application startup complete" in line]
    assert uvicorn_up and uvicorn_up[0] < ready[0]
    assert any("start-up: ready in" in line and "weights read" in line for line in log)
    assert sum("CPU threads per engine process" in line for line in log) == 1

    # --chat-template replaces the model's: the prompt starts with the template's fixed text.
    with_template = httpx.post(
        f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}
    ).json()
    plain = httpx.post(f"{server.url}/tokenize", json={"prompt": "FIXED-PREFIX hi"}).json()
    assert with_template["tokens"] == plain["tokens"]

    # CORS: the allowed origin gets its headers (a preflight too), another origin none.
    ok = httpx.options(
        f"{server.url}/v1/models",
        headers={"Origin": "http://app.example", "Access-Control-Request-Method": "GET"},
    )
    assert ok.headers.get("access-control-allow-origin") == "http://app.example"
    other = httpx.get(f"{server.url}/v1/models", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in other.headers
    assert server.stop() == 0
    assert not any("atom_runtime.server.stats" in line for line in server.log().splitlines())


def test_no_cors_headers_without_allowed_origins(server):
    resp = httpx.get(f"{server.url}/v1/models", headers={"Origin": "http://app.example"})
    assert resp.status_code == 200 and "access-control-allow-origin" not in resp.headers

"""The published API description: /openapi.json types every request and response, /docs and
/redoc load nothing from the internet, and schemathesis, generating requests from that schema
(a bounded number per route), never gets a 5xx and every answer matches the documented
status codes, content types and schemas."""

from __future__ import annotations

import re

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.specs.openapi import checks as openapi_checks

from tests.server.conftest import TINY_FLAGS

GUARD_S = 300  # deadlock guard for client reads
CASES_PER_ROUTE = 20


@pytest.fixture(scope="module")
def schema_server(tiny_models, launch_module_server):
    # A short context keeps every generated request cheap: max_tokens past it is a quick 400.
    srv = launch_module_server(
        "--model", str(tiny_models["llama"]), *TINY_FLAGS, "--max-model-len", "48",
        "--enable-debug-endpoints",
    )  # fmt: skip
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def published(schema_server) -> dict:
    return httpx.get(f"{schema_server.url}/openapi.json", timeout=GUARD_S).json()


def test_every_route_is_typed(published):
    paths = published["paths"]
    components = published["components"]["schemas"]
    assert set(paths) == {
        "/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/version",
        "/metrics", "/tokenize", "/detokenize", "/reset_prefix_cache", "/debug/kv_cache",
    }  # fmt: skip
    for path, operations in paths.items():
        for method, op in operations.items():
            ok = op["responses"]["200"]["content"]
            assert all(media["schema"] for media in ok.values()), (path, method)
            if method == "post" and path != "/reset_prefix_cache":
                ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
                body = components[ref.rsplit("/", 1)[1]]
                assert body["properties"], (path, body)
    completion = components["CompletionRequest"]
    assert "prompt" in completion["required"]
    assert {"max_tokens", "temperature", "n", "logprobs", "echo"} <= set(completion["properties"])
    assert components["ErrorResponse"]["required"] == ["error"]


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_docs_pages_load_their_assets_from_the_server(schema_server, page):
    html = httpx.get(f"{schema_server.url}{page}", timeout=GUARD_S).text
    urls = re.findall(r"""(?:src|href)=["']([^"']+)["']""", html)
    urls += re.findall(r"""url: ?["']([^"']+)["']""", html)
    assert urls and not [u for u in urls if "//" in u], urls  # nothing from another host
    for url in urls:
        r = httpx.get(f"{schema_server.url}{url}", timeout=GUARD_S)
        assert r.status_code == 200 and r.content, url


CHECKS = [
    schemathesis.checks.not_a_server_error,
    openapi_checks.status_code_conformance,
    openapi_checks.content_type_conformance,
    openapi_checks.response_schema_conformance,
]


def test_generated_requests_get_no_server_error(schema_server):
    """CASES_PER_ROUTE generated requests per route (derandomized: the same ones every run)."""
    schema = schemathesis.openapi.from_url(f"{schema_server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == 10
    sent = []
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=CASES_PER_ROUTE,
            deadline=None,
            derandomize=True,
            database=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        def run(case):
            sent.append(case.call_and_validate(timeout=GUARD_S, checks=CHECKS).status_code)

        run()
    # Routes with a body got their full share (routes with no input need one request each).
    assert len(sent) >= 4 * CASES_PER_ROUTE
    assert httpx.get(f"{schema_server.url}/health", timeout=GUARD_S).status_code == 200

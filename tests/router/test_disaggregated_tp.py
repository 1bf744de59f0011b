"""Prefill/decode as production runs it, with real processes on 127.0.0.1: a prefill engine at
tensor-parallel size 2 and a decode engine at size 1, over the NIXL connector (DRAM to DRAM
through UCX), behind `atom router`. Pins: answers (completions and streamed chat) equal the
prefill engine's own aggregated ones, each from one pull of the decode rank's heads from both
prefill ranks with no fallback; every hold is released; clients see no transfer params."""

from __future__ import annotations

import httpx
import pytest

from tests.router.conftest import launch_engine, launch_router, prompt_ids, transfer_config
from tests.router.test_disaggregated import _stream, _wait
from tests.server.conftest import free_port, free_ports

pytest.importorskip("nixl_cu12._api", reason="NIXL (pip install --no-deps nixl-cu12) is absent")
pytestmark = pytest.mark.slow

BLOCK = 16
NIXL = "NixlConnector"


@pytest.fixture(scope="module")
def pd_tp(tiny_models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pd_tp")
    model = tiny_models["llama"]  # 2 KV heads: one a prefill rank
    procs = []
    try:
        prefill = launch_engine(
            tmp, model, "--tensor-parallel-size", "2",
            "--kv-transfer-config", transfer_config("kv_producer", free_ports(2), NIXL),
        )  # fmt: skip
        procs.append(prefill.server)
        decode = launch_engine(
            tmp, model, "--kv-transfer-config",
            transfer_config("kv_consumer", free_port(), NIXL, pull_timeout_s=60),
        )  # fmt: skip
        procs.append(decode.server)
        router = launch_router(
            tmp, "--backend", decode.backend_arg, "--prefill-backend", prefill.url,
            "--remote-prefill-threshold", str(BLOCK),
        )  # fmt: skip
        procs.append(router)
        router.wait_backends("decode", 1)
        router.wait_backends("prefill", 1)
        yield prefill, decode, router
    finally:
        for p in reversed(procs):
            p.stop()


def test_tp2_prefill_to_tp1_decode_over_nixl_answers_as_aggregated(pd_tp, model_name):
    prefill, decode, router = pd_tp
    pulls0 = decode.metric("atom:kv_transfer_pulls_total")
    body = {"model": model_name, "prompt": prompt_ids(11), "max_tokens": 6, "temperature": 0}
    ref = httpx.post(f"{prefill.url}/v1/completions", json=body, timeout=120).json()
    got = httpx.post(f"{router.url}/v1/completions", json=body, timeout=120).json()
    assert got["choices"][0]["text"] == ref["choices"][0]["text"]
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 144  # 9 of 10 blocks pulled
    assert "kv_transfer_params" not in got

    words = " ".join(f"u{i}" for i in range(70))
    chat = {
        "model": model_name,
        "messages": [{"role": "user", "content": words}],
        "max_tokens": 5,
        "temperature": 0,
    }
    ref_chat = httpx.post(f"{prefill.url}/v1/chat/completions", json=chat, timeout=120).json()
    assert (
        _stream(router.url, "/v1/chat/completions", chat)
        == (ref_chat["choices"][0]["message"]["content"])
    )

    assert decode.metric("atom:kv_transfer_pulls_total") - pulls0 == 2
    assert decode.metric("atom:kv_transfer_fallbacks_total") == 0
    _wait(lambda: prefill.metric("atom:kv_transfer_held_blocks") == 0, what="holds released")
    assert prefill.metric("atom:kv_transfer_holds_released_total") >= 2
    assert decode.metric("atom:kv_cache_usage_ratio") == 0

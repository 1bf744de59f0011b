"""`atom serve` on a tiny hybrid model (Qwen3.5-shaped, random weights): completions stream and
finish, the start-up log says how many state slots there are and that prefix reuse is off, and
/metrics reports the slot pool."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.server.conftest import TINY_FLAGS

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def hybrid_server(tiny_hybrid_models, launch_module_server):
    srv = launch_module_server(
        "--model",
        str(tiny_hybrid_models["qwen3_5"]),
        *TINY_FLAGS,
        "--max-num-seqs",
        "4",
    )
    yield srv
    code = srv.stop()
    assert code == 0, f"atom serve exited with {code}:\n{srv.log()}"


def _gauge(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    if m is None:
        raise AssertionError(f"{name} not in /metrics:\n{text}")
    return float(m.group(1))


def test_hybrid_model_serves_completions_and_reports_its_slots(hybrid_server):
    url = hybrid_server.url
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": "Hello there, how are", "max_tokens": 6, "temperature": 0}
    first = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    assert first["usage"]["completion_tokens"] == 6
    # Greedy and no prefix reuse: the same prompt again gives the same text, nothing cached.
    again = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    details = again["usage"].get("prompt_tokens_details") or {}
    assert details.get("cached_tokens", 0) == 0
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60
    ) as r:
        chunks = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert chunks[-1] == "data: [DONE]"
    text = httpx.get(f"{url}/metrics").text
    assert _gauge(text, "atom:state_slots_total") == 4
    assert _gauge(text, "atom:state_slots_in_use") == 0
    assert re.search(r'atom:state_slot_config_info\{.*bytes_per_slot="\d+"', text)
    log = hybrid_server.log()
    assert "hybrid state: 4 slots" in log
    assert "prefix reuse for hybrid models needs state checkpoints" in log

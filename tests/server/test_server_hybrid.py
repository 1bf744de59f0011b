"""`atom serve` on a tiny hybrid model (Qwen3.5-shaped, random weights): completions stream and
finish, the start-up log says how many state slots there are and that state checkpoints are on
by default, a repeated prompt is served from a checkpoint (`cached_tokens` > 0, the same greedy
text), and /metrics reports the slot pool and the checkpoint counters."""

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
    assert "state checkpoints: interval anchors only, demand rungs on" in log


def test_a_repeated_prompt_resumes_from_a_state_checkpoint(hybrid_server):
    """Out of the box (interval -1): the first request stores its prompt-end anchor, the same
    prompt again resumes there and generates the same greedy text; cached_tokens adds up to the
    tokens the engine resumed from checkpoints."""
    url = hybrid_server.url
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    resumed_before = _gauge(
        httpx.get(f"{url}/metrics").text, "atom:state_checkpoint_prefix_hit_tokens_total"
    )
    prompt = "You are a careful assistant who answers in one short sentence. " * 4
    body = {"model": model, "prompt": prompt, "max_tokens": 5, "temperature": 0}
    first = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    assert first["usage"]["prompt_tokens"] > 32
    outs = [httpx.post(f"{url}/v1/completions", json=body, timeout=60).json() for _ in range(2)]
    cached = [(o["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) for o in outs]
    assert max(cached) > 0, cached
    assert all(o["choices"][0]["text"] == first["choices"][0]["text"] for o in outs)
    text = httpx.get(f"{url}/metrics").text
    assert _gauge(text, "atom:state_checkpoints_stored_total") >= 1
    assert _gauge(text, "atom:state_checkpoints_restored_total") >= 1
    # cached_tokens is the length resumed from a checkpoint, not the (deeper) KV hit.
    resumed = _gauge(text, "atom:state_checkpoint_prefix_hit_tokens_total") - resumed_before
    assert resumed == sum(cached)
    assert 0 < _gauge(text, "atom:state_checkpoint_units_ratio") <= 0.1
    assert _gauge(text, "atom:state_slots_in_use") == 0


# Issue 15's metrics (contract 8: `atom:` prefix, counters end `_total`), one series each.
CHECKPOINT_COUNTERS = {
    "atom:state_checkpoints_stored": [""],
    "atom:state_checkpoints_restored": [""],
    "atom:state_checkpoints_dropped": [""],
    "atom:state_checkpoints_evicted": [""],
    "atom:state_checkpoints_orphaned": [""],
    "atom:state_checkpoint_chunks_cut": [
        '{reason="rung"}',
        '{reason="anchor"}',
        '{reason="demand"}',
        '{reason="handoff"}',
    ],
    "atom:state_checkpoint_demands": ['{outcome="recorded"}', '{outcome="declined"}'],
    "atom:state_checkpoint_prefix_hit_tokens": [""],
    "atom:state_checkpoint_hit_lost_tokens": [""],
}
CHECKPOINT_GAUGES = ("atom:state_checkpoint_units", "atom:state_checkpoint_units_ratio")


def test_every_state_checkpoint_metric_is_on_metrics(hybrid_server):
    """Each counter is typed a counter and exposed only as `<name>_total` (one series per label
    value); the units gauge and its share of the KV pool (`cache_config_info`'s blocks) are
    there too."""
    text = httpx.get(f"{hybrid_server.url}/metrics").text
    for name, labels in CHECKPOINT_COUNTERS.items():
        assert f"# TYPE {name}_total counter" in text, name
        series = re.findall(rf"^{re.escape(name)}(\S*) \S+$", text, re.MULTILINE)
        assert sorted(series) == sorted(f"_total{label}" for label in labels), name
    for name in CHECKPOINT_GAUGES:
        assert f"# TYPE {name} gauge" in text, name
    blocks = re.search(r'^atom:cache_config_info\{.*num_gpu_blocks="(\d+)"', text, re.MULTILINE)
    units = _gauge(text, "atom:state_checkpoint_units")
    assert _gauge(text, "atom:state_checkpoint_units_ratio") == units / int(blocks.group(1))

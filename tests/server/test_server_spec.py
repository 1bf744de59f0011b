"""`atom serve --speculative-config` on a tiny Qwen3.5 with an MTP layer (random weights): vLLM's
JSON flag, completions streamed and not, and /metrics carrying the speculative-decoding
counters under vLLM's names (`atom:` prefix) with what the requests drafted."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.server.conftest import TINY_FLAGS, wait_for

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory, launch_module_server):
    from tests.model_factory import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("serve_mtp") / "qwen3_5", "qwen3_5",
                            mtp_layers=1)  # fmt: skip
    srv = launch_module_server(
        "--model", str(model), *TINY_FLAGS, "--max-num-seqs", "4",
        "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}',
    )  # fmt: skip
    yield srv
    code = srv.stop()
    assert code == 0, f"atom serve exited with {code}:\n{srv.log()}"


def _counter(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    if m is None:
        raise AssertionError(f"{name} not in /metrics:\n{text}")
    return float(m.group(1))


def test_served_completions_draft_and_metrics_count_them(spec_server):
    url = spec_server.url
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": "one two three one two three", "max_tokens": 12,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    first = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
    assert first["usage"]["completion_tokens"] == 12
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120
    ) as r:
        chunks = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert chunks[-1] == "data: [DONE]"

    def drafted_page():  # the engine's stats ride its output messages: wait for a step's
        page = httpx.get(f"{url}/metrics").text
        return page if _counter(page, "atom:spec_decode_num_drafts_total") > 0 else None

    text = wait_for(drafted_page, what="drafts on /metrics")
    drafts = _counter(text, "atom:spec_decode_num_drafts_total")
    drafted = _counter(text, "atom:spec_decode_num_draft_tokens_total")
    accepted = _counter(text, "atom:spec_decode_num_accepted_tokens_total")
    emitted = _counter(text, "atom:spec_decode_num_emitted_tokens_total")
    assert 0 < drafts and drafts <= drafted <= 2 * drafts
    assert 0 <= accepted <= drafted and emitted == accepted + drafts
    assert 'atom:spec_decode_num_accepted_tokens_per_pos_total{position="1"}' in text
    assert _counter(text, "atom:spec_decode_acceptance_length_count") == drafts

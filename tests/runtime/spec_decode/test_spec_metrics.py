"""The speculative-decoding counters with vLLM's meanings under `atom:` names: what one verify
step adds, their trip over the engine socket, and their Prometheus families on /metrics."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from atom_runtime.protocol import codec
from atom_runtime.protocol.engine_core import EngineStats, Outputs, StepOutputs
from atom_runtime.protocol.spec_decode_stats import SpecDecodingStats
from atom_runtime.server.metrics import EngineStatsCollector


def _stats() -> SpecDecodingStats:
    s = SpecDecodingStats(3)
    s.observe(3, 2)  # drafts 1, 2 accepted; 3 rejected
    s.observe(3, 3)
    s.observe(1, 0)
    s.observe(0, 0)  # no drafts: not a draft
    return s


def test_one_verify_step_counts_as_vllm_counts_it():
    s = _stats()
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (3, 7, 5)
    assert s.accepted_per_pos == [2, 2, 1]
    assert s.num_emitted_tokens == 8  # (2 + 1) + (3 + 1) + (0 + 1)
    assert s.acceptance_lengths == [1, 0, 1, 1]  # drafts that accepted 0, 1, 2, 3 tokens
    assert s.acceptance_rate == pytest.approx(5 / 7)
    assert s.mean_acceptance_length == pytest.approx(1 + 5 / 3)
    with pytest.raises(ValueError, match="num_accepted"):
        s.observe(2, 3)


def test_the_counters_cross_the_engine_socket():
    stats = EngineStats(0, 0, 0.0, 8, 16, 0, 0, 0, 0, 0, spec_decoding=_stats())
    raw = codec.encoder().encode(Outputs(StepOutputs(), stats))
    back = codec.decoder(Outputs).decode(raw)
    assert back.stats.spec_decoding == stats.spec_decoding


def test_metrics_page_carries_the_spec_decode_families():
    stats = EngineStats(0, 0, 0.0, 8, 16, 0, 0, 0, 0, 0, spec_decoding=_stats())
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineStatsCollector(lambda: stats))
    page = generate_latest(registry).decode()
    for line in (
        "atom:spec_decode_num_drafts_total 3.0",
        "atom:spec_decode_num_draft_tokens_total 7.0",
        "atom:spec_decode_num_accepted_tokens_total 5.0",
        "atom:spec_decode_num_emitted_tokens_total 8.0",
        'atom:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 2.0',
        'atom:spec_decode_num_accepted_tokens_per_pos_total{position="2"} 1.0',
        'atom:spec_decode_acceptance_length_bucket{le="1.0"} 1.0',
        'atom:spec_decode_acceptance_length_bucket{le="+Inf"} 3.0',
        "atom:spec_decode_acceptance_length_count 3.0",
        "atom:spec_decode_acceptance_length_sum 8.0",
    ):
        assert line in page
    plain = EngineStats(0, 0, 0.0, 8, 16, 0, 0, 0, 0, 0)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineStatsCollector(lambda: plain))
    assert "spec_decode" not in generate_latest(registry).decode()

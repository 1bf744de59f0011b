"""Which captured graph a step replays: the decode sizes and the prefill buckets (CPU: the
choice of sizes only; capture and replay are checked on the GPU, test_gpu_engine.py)."""

from __future__ import annotations

import pytest

from atom_runtime.config import EngineConfig
from atom_runtime.worker.cuda_graphs import (
    PrefillGraphs,
    default_capture_sizes,
    default_prefill_buckets,
)


def test_decode_sizes_follow_vllm():
    assert default_capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert default_capture_sizes(3) == [1, 2, 3]
    assert default_capture_sizes(1024)[-1] == 512


def test_prefill_buckets_cover_tokens_and_sequences():
    buckets = default_prefill_buckets(256, 256)
    assert {t for t, _ in buckets} == {16, 32, 64, 128, 256}
    assert {s for _, s in buckets} == {1, 2, 4, 8}
    assert len(buckets) == 20
    # An odd limit is a bucket of its own; sequences never outnumber tokens or max_num_seqs.
    assert default_prefill_buckets(100, 2) == [
        (16, 1), (16, 2), (32, 1), (32, 2), (64, 1), (64, 2), (100, 1), (100, 2),
    ]  # fmt: skip
    assert default_prefill_buckets(4, 8) == [(4, 1), (4, 2), (4, 4)]
    assert default_prefill_buckets(0, 8) == []


def _graphs(buckets, max_blocks=64) -> PrefillGraphs:
    graphs = PrefillGraphs()
    graphs.buckets = sorted(buckets)
    graphs._max_blocks = max_blocks
    return graphs


def test_a_step_takes_the_smallest_bucket_that_holds_it():
    graphs = _graphs(default_prefill_buckets(256, 8))
    assert graphs.bucket_for(tokens=64, seqs=1, samples=1, width=10) == (64, 1)
    assert graphs.bucket_for(tokens=65, seqs=1, samples=1, width=10) == (128, 1)
    assert graphs.bucket_for(tokens=20, seqs=3, samples=3, width=10) == (32, 4)
    # Prompt logprobs: more sample rows than sequences need a wider bucket, or none.
    assert graphs.bucket_for(tokens=20, seqs=1, samples=6, width=10) == (32, 8)
    assert graphs.bucket_for(tokens=20, seqs=1, samples=9, width=10) is None
    # Too many tokens or sequences, or a block table wider than the captured one: eager.
    assert graphs.bucket_for(tokens=257, seqs=1, samples=1, width=10) is None
    assert graphs.bucket_for(tokens=40, seqs=9, samples=9, width=10) is None
    assert graphs.bucket_for(tokens=16, seqs=1, samples=1, width=65) is None


def test_prefill_graph_limit_is_a_checked_engine_flag():
    assert EngineConfig().prefill_graph_max_tokens == 256
    assert EngineConfig(prefill_graph_max_tokens=0).prefill_graph_max_tokens == 0
    with pytest.raises(ValueError, match="prefill_graph_max_tokens"):
        EngineConfig(prefill_graph_max_tokens=-1)

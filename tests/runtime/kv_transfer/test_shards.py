"""Heterogeneous tensor parallelism's head plan (shards.py) and head slices over the portable
connector. Pins: every decode rank gets exactly the heads it owns, once, from producer ranks that
hold them (split and replicated heads, d >= p and d < p); sizes that do not divide are refused by
name; a head slice pulled over real TCP stripes lands exactly, through the sockets on the blocks
(CPU) and through staging buffers (the GPU path's gather/scatter over sliced views)."""

from __future__ import annotations

import json

import pytest
import torch

from atom_runtime.kv_transfer.base import KVCacheAccess, RemoteBlocks
from atom_runtime.kv_transfer.config import KVTransferConfig
from atom_runtime.kv_transfer.shards import plan_sources, rank_heads
from atom_runtime.kv_transfer.tcp import TCPConnector
from atom_runtime.layers.attention import PagedAttention
from tests.runtime.kv_transfer.conftest import BS, NUM_BLOCKS, _until
from tests.server.conftest import free_port


@pytest.mark.parametrize(
    ("heads", "p", "d"),
    [(8, 1, 2), (8, 2, 1), (8, 2, 8), (8, 8, 2), (8, 4, 4), (2, 1, 8), (2, 8, 1), (2, 4, 8)],
)
def test_every_decode_rank_gets_exactly_its_heads_from_their_holders(heads, p, d):
    for r in range(d):
        want = rank_heads(r, d, heads)
        got = []
        for src in plan_sources(heads, p, d, r):
            first, end = rank_heads(src.rank, p, heads)
            a, b = src.src or (0, end - first)
            assert 0 <= a < b <= end - first  # inside the producer rank's own heads
            got.extend(range(first + a, first + b))
            x, y = src.dst or (0, want[1] - want[0])
            assert y - x == b - a
        assert got == list(range(*want))  # each owned head once, in order


def test_a_replicated_head_is_read_from_one_holder_spread_by_rank():
    # 2 heads on 8 prefill ranks: ranks 0-3 hold head 0, 4-7 head 1; 4 decode ranks.
    sources = [plan_sources(2, 8, 4, r) for r in range(4)]
    assert all(len(s) == 1 and s[0].src is None and s[0].dst is None for s in sources)
    ranks = [s[0].rank for s in sources]
    assert all(rank_heads(q, 8, 2)[0] == rank_heads(r, 4, 2)[0] for r, q in enumerate(ranks))
    assert len(set(ranks)) == 4


def test_a_latent_cache_is_read_whole_from_one_rank():
    assert [s.rank for r in range(4) for s in plan_sources(None, 2, 4, r)] == [0, 1, 0, 1]


@pytest.mark.parametrize(("heads", "p", "d"), [(8, 3, 1), (6, 4, 2), (8, 1, 3)])
def test_sizes_that_do_not_divide_are_refused_by_name(heads, p, d):
    with pytest.raises(ValueError, match="cannot be split over tensor_parallel_size"):
        plan_sources(heads, p, d, 0)


def _cache(heads: int, direct: bool) -> KVCacheAccess:
    layers = []
    for _ in range(2):
        layer = PagedAttention(heads, heads, 8, 1.0)
        layer.bind_cache([torch.randn(NUM_BLOCKS, BS, heads, 8) for _ in range(2)])
        layers.append(layer)
    return KVCacheAccess(layers, direct=direct, kv_heads=4)


def _tcp(role: str, kv: KVCacheAccess) -> TCPConnector:
    raw = {"kv_connector": "TCPConnector", "kv_role": role, "kv_ip": "127.0.0.1"}
    raw["kv_port"] = free_port()
    return TCPConnector(KVTransferConfig.from_cli(json.dumps(raw)), kv, chunk_bytes=4096)


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize(
    ("src", "dst", "local_heads"),
    [((2, 4), None, 2), ((1, 2), (1, 2), 2), (None, (2, 4), 4)],
    ids=["p1-d2-rank1", "a-head-into-a-slice", "p2-d1-rank1-into-a-slice"],
)
def test_a_head_slice_over_tcp_lands_exactly(transfer_key, direct, src, dst, local_heads):
    whole = _cache(4 if src is not None else 2, direct)
    local = _cache(local_heads, direct)
    producer, consumer = _tcp("kv_producer", whole), _tcp("kv_consumer", local)
    try:
        ids, into = [1, 2, 3, 10, 7], [5, 6, 20, 0, 11]
        producer.offer("t", ids)
        host, port = producer.address()
        consumer.start_pull(RemoteBlocks("t", host, port, ids, src, dst), into, 60)
        results = []
        _until(lambda: results.extend(consumer.completed()) or results)
        assert results[0].error is None
        a, b = src or (0, whole.local_heads)
        x, y = dst or (0, local.local_heads)
        for theirs, ours in zip(whole.full_caches, local.full_caches, strict=True):
            assert torch.equal(theirs[ids][:, :, a:b], ours[into][:, :, x:y])
    finally:
        producer.close()
        consumer.close()

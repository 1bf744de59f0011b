"""KV transfer with an FP8 cache: the layout string names the dtype (and the k/v scales when
they are not 1.0), so a bf16 consumer refuses an FP8 producer by name and writes nothing, and
FP8 blocks travel between FP8 engines byte for byte."""

from __future__ import annotations

import functools

import pytest
import torch

from atom_runtime.kv_transfer.base import KVCacheAccess
from tests.runtime.kv_transfer.test_kv_transfer import (
    _connectors,
    _paged_layer,
    _pull_direct,
    _wire_bytes,
)

FP8 = torch.float8_e4m3fn


def _fp8_layer(fill: bool, dtype=None, scales=(1.0, 1.0)):
    layer = _paged_layer(fill, dtype=FP8)
    layer.k_scale, layer.v_scale = scales
    return layer


def test_the_layout_names_an_fp8_cache_and_its_scales():
    assert KVCacheAccess([_fp8_layer(False) for _ in range(2)]).layout == (
        "2L/kv:2/16x2x8/float8_e4m3fn"
    )
    scaled = KVCacheAccess([_fp8_layer(False, scales=(0.5, 2.0)) for _ in range(2)]).layout
    assert scaled.startswith("2L/kv:2/16x2x8/float8_e4m3fn/scales:")
    other = KVCacheAccess([_fp8_layer(False, scales=(0.5, 1.0)) for _ in range(2)]).layout
    assert other != scaled


@pytest.mark.parametrize(
    "layers, names",
    [
        ((_fp8_layer, _paged_layer), ("float8_e4m3fn", "bfloat16")),
        ((_paged_layer, _fp8_layer), ("bfloat16", "float8_e4m3fn")),
        (
            (functools.partial(_fp8_layer, scales=(0.5, 0.5)), _fp8_layer),
            ("float8_e4m3fn/scales:", "float8_e4m3fn"),
        ),
    ],
    ids=["fp8-to-bf16", "bf16-to-fp8", "other-scales"],
)
def test_a_consumer_refuses_a_producer_of_another_cache_dtype_by_name(layers, names):
    producer, consumer = _connectors(True, 1, layers=layers)
    try:
        (result,) = _pull_direct(producer, consumer, "t-dtype", [1, 2], [3, 4])
        assert result.error is not None
        assert all(name in result.error for name in names), result.error
        assert not any(c.view(torch.uint8).any() for c in consumer.kv.caches)  # nothing written
    finally:
        producer.close()
        consumer.close()


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "staged"])
def test_fp8_blocks_travel_exactly(direct):
    producer, consumer = _connectors(direct, 3, layers=(_fp8_layer, _fp8_layer))
    try:
        ids, into = [3, 1, 2, 7], [20, 5, 6, 7]
        want = _wire_bytes(producer.kv, ids)
        (result,) = _pull_direct(producer, consumer, "t-fp8", ids, into)
        assert result.error is None and result.nbytes == len(ids) * 3 * 2 * 16 * 2 * 8
        assert _wire_bytes(consumer.kv, into) == want
    finally:
        producer.close()
        consumer.close()

"""The host -> device copies of a step (device.py): several arrays packed into one staging
buffer at aligned offsets and viewed back with their dtypes and shapes, bytes unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from atom_runtime.system.device import pack_into, pack_layout, to_device_many, unpack_views

ARRAYS = [
    np.array([5, -9, 2**40], dtype=np.int64),
    np.array([[1, 0, 7], [2, 4, -1]], dtype=np.int32),  # a 2-D block table
    np.array([True, False, True], dtype=np.bool_),
    np.zeros(0, dtype=np.int64),  # an empty field (no sample rows)
    np.array([0.5, -1.25], dtype=np.float32),
    np.arange(3, dtype=np.int32),
]


def test_layout_aligns_every_array_to_16_bytes():
    offsets, total = pack_layout(ARRAYS)
    assert offsets == [0, 32, 64, 80, 80, 96]
    assert total == 112
    assert pack_layout([np.zeros(0, dtype=np.int64)]) == ([0], 16)  # never a 0-byte buffer


def test_packed_arrays_come_back_with_their_dtypes_shapes_and_values():
    offsets, total = pack_layout(ARRAYS)
    buffer = torch.full((total,), 0xAB, dtype=torch.uint8)  # padding bytes stay as they are
    pack_into(buffer.numpy(), ARRAYS, offsets)
    views = unpack_views(buffer, ARRAYS, offsets)
    for got, want in zip(views, ARRAYS, strict=True):
        assert got.dtype == torch.from_numpy(want).dtype and tuple(got.shape) == want.shape
        assert np.array_equal(got.numpy(), want)


def test_on_the_cpu_the_arrays_are_not_copied():
    got = to_device_many(ARRAYS, torch.device("cpu"))
    for t, a in zip(got, ARRAYS, strict=True):
        if a.size:  # an empty array has no data to share
            assert t.data_ptr() == a.__array_interface__["data"][0]


@pytest.mark.gpu
def test_one_copy_to_the_gpu_gives_the_arrays():
    strided = np.arange(12, dtype=np.int64)[::2]  # not contiguous: packed by value
    got = to_device_many([*ARRAYS, strided], torch.device("cuda"))
    torch.cuda.synchronize()
    for t, a in zip(got, [*ARRAYS, strided], strict=True):
        assert t.is_cuda and np.array_equal(t.cpu().numpy(), a)

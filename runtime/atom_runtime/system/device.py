"""Device and dtype names from the config, and the host -> device copies every step uses."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_device(name: str) -> torch.device:
    """ "auto": the GPU when there is one, else the CPU. A GPU that is not there raises
    ValueError naming --device (torch's own error is an AssertionError about its build)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r}: expected auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(
                f"--device {name}: no CUDA or ROCm GPU is visible here (torch {torch.__version__}"
                f"{'' if torch.version.cuda or torch.version.hip else ', a CPU-only build'}); "
                "use --device cpu or auto (a GPU build: docs/install-gpu.md)"
            )
        if device.index is not None and device.index >= count:
            raise ValueError(f"--device {name}: this machine has {count} GPU(s), cuda:0..")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """ "auto": bf16 on a GPU, fp32 on the CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on `device` without a host sync: staged through pinned memory (the caching
    host allocator keeps the block until the copy has run), then copied asynchronously."""
    t = torch.from_numpy(array)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


# Offsets of the arrays packed by `to_device_many`: 16 bytes covers every dtype's alignment.
_PACK_ALIGN = 16


def to_device_many(arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Several host arrays on `device` with one copy, no host sync: packed into one pinned
    staging buffer, copied asynchronously, and viewed back as tensors of their dtypes and
    shapes (views into one device buffer). One pinned allocation and one copy per step instead
    of one of each per array. On the CPU the arrays come back as they are, uncopied."""
    if device.type == "cpu":
        return [torch.from_numpy(a) for a in arrays]
    arrays = [np.ascontiguousarray(a) for a in arrays]
    offsets, total = pack_layout(arrays)
    staging = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    pack_into(staging.numpy(), arrays, offsets)
    return unpack_views(staging.to(device, non_blocking=True), arrays, offsets)


def pack_layout(arrays: Sequence[np.ndarray]) -> tuple[list[int], int]:
    """Byte offset of each array in the packed buffer (aligned), and the buffer's size."""
    offsets, at = [], 0
    for a in arrays:
        offsets.append(at)
        at += -(-a.nbytes // _PACK_ALIGN) * _PACK_ALIGN
    return offsets, max(at, _PACK_ALIGN)


def pack_into(buffer: np.ndarray, arrays: Sequence[np.ndarray], offsets: list[int]) -> None:
    """Copy each (contiguous) array's bytes into the uint8 `buffer` at its offset."""
    for a, at in zip(arrays, offsets, strict=True):
        buffer[at : at + a.nbytes] = a.reshape(-1).view(np.uint8)


def unpack_views(
    buffer: torch.Tensor, arrays: Sequence[np.ndarray], offsets: list[int]
) -> list[torch.Tensor]:
    """The packed arrays as typed, shaped views of the uint8 tensor `buffer`."""
    return [
        buffer[at : at + a.nbytes].view(_torch_dtype(a.dtype)).view(a.shape)
        for a, at in zip(arrays, offsets, strict=True)
    ]


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype

"""Device and dtype names from the config, and the host -> device copy every step uses."""

from __future__ import annotations

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
    """ "auto": the GPU when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


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

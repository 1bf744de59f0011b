"""Copying checkpoint tensors into parameters: the one step every layer's weight loader ends with."""

from __future__ import annotations

import torch

from atom_kernels.fp8_formats import is_fp8


def copy_weight(dst: torch.Tensor, src) -> None:
    """Copy a checkpoint tensor (or this rank's narrowed part of it) into a parameter. A lazy
    checkpoint tensor that reaches here whole is read whole: the parameter is replicated. An FP8
    tensor only goes into an FP8 parameter and the other way round (a cast would drop or invent
    its scales)."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"checkpoint tensor {tuple(src.shape)} does not fit {tuple(dst.shape)}")
    data = src if isinstance(src, torch.Tensor) else src.read()
    if is_fp8(data) != is_fp8(dst):
        raise ValueError(
            f"checkpoint tensor in {data.dtype} for a parameter in {dst.dtype}: an FP8 weight "
            "loads only into an FP8 layer (is the layer in the quantization config's ignore "
            "list, or the checkpoint's quantization_config missing?)"
        )
    dst.copy_(data)

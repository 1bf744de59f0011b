"""Copying checkpoint tensors into parameters: the one step every layer's weight loader ends with."""

from __future__ import annotations

import torch


def copy_weight(dst: torch.Tensor, src) -> None:
    """Copy a checkpoint tensor (or this rank's narrowed part of it) into a parameter. A lazy
    checkpoint tensor that reaches here whole is read whole: the parameter is replicated."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"checkpoint tensor {tuple(src.shape)} does not fit {tuple(dst.shape)}")
    dst.copy_(src if isinstance(src, torch.Tensor) else src.read())

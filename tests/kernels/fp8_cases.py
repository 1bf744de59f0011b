"""FP8 test inputs shared by the FP8 kernel tests: quantized weights in each checkpoint layout."""

from __future__ import annotations

import torch

from atom_kernels.fp8_formats import (
    quantize_weight_block,
    quantize_weight_per_channel,
    quantize_weight_per_tensor,
)

LAYOUTS = ("tensor", "channel", "block")


def quantized_weight(
    layout: str,
    n: int,
    k: int,
    fp8: torch.dtype,
    device: torch.device | str,
    seed: int = 5,
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int] | None]:
    """(q `[n, k]`, fp32 scale, weight_block_size) of a random weight whose rows span two orders
    of magnitude (so per-channel and block scales differ from one another), quantized per
    tensor, per channel or in 128 x 128 blocks."""
    g = torch.Generator().manual_seed(seed + n + k)
    w = torch.randn(n, k, generator=g) / k**0.5 * torch.logspace(-1, 1, n)[:, None]
    if layout == "block":
        q, s = quantize_weight_block(w, (128, 128), fp8)
        block = (128, 128)
    elif layout == "channel":
        (q, s), block = quantize_weight_per_channel(w, fp8), None
    elif layout == "tensor":
        (q, s), block = quantize_weight_per_tensor(w, fp8), None
    else:
        raise ValueError(f"layout {layout!r}: expected one of {LAYOUTS}")
    return q.to(device), s.to(device), block

"""MXFP4 (OCP microscaling FP4) weights, as GPT-OSS checkpoints store their experts: each row
is cut into groups of 32 values; a group is 16 bytes of packed FP4 E2M1 codes (two a byte, the
low nibble first) and one E8M0 scale byte (the power of two 2^(scale - 127)). ATOM dequantizes
them at load time to the run's dtype (native MXFP4 GEMMs are a later step)."""

from __future__ import annotations

import torch

# The 16 values of an FP4 E2M1 code (sign bit, two exponent bits, one mantissa bit).
FP4_E2M1_VALUES = (
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)  # fmt: skip
GROUP = 32  # values per scale


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """blocks uint8 `[..., G, 16]` and scales uint8 `[..., G]` -> `[..., G * 32]` in `dtype`,
    on blocks' device. Exact: every value is a small float times a power of two."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"MXFP4 blocks and scales must be uint8, got {blocks.dtype}, {scales.dtype}"
        )
    if blocks.shape[-1] != GROUP // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} must be scales' shape {tuple(scales.shape)} "
            f"plus a last dim of {GROUP // 2}"
        )
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    out = torch.empty((*blocks.shape[:-1], GROUP), dtype=torch.float32, device=blocks.device)
    out[..., 0::2] = lut[(blocks & 0x0F).long()]
    out[..., 1::2] = lut[(blocks >> 4).long()]
    exponent = scales.to(device=blocks.device, dtype=torch.int32) - 127
    out = torch.ldexp(out, exponent.unsqueeze(-1).float())
    return out.flatten(-2).to(dtype)

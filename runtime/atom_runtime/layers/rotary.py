"""Rotary position embedding with a precomputed cos/sin table, including Llama 3's frequency
scaling (`rope_type: llama3`) and YaRN (`rope_type: yarn`: interpolated low frequencies, and an
attention factor folded into the table; DeepSeek's MLA also scales its softmax by
`softmax_scale_correction`). Formulas as transformers' modeling_rope_utils computes them."""

from __future__ import annotations

import math

import torch
from torch import nn


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    rope_type = _rope_type(scaling)
    if rope_type in (None, "default"):
        return inv_freq.float()
    if rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        is_mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        return torch.where(is_mid, mid, scaled).float()
    if rope_type == "linear":
        return (inv_freq / scaling["factor"]).float()
    if rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling).float()
    raise ValueError(f"rope_scaling: rope_type {rope_type!r} is not supported")


def _yarn_inv_freq(inv_freq: torch.Tensor, dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN: frequencies below the correction range are interpolated (divided by the factor),
    those above kept, a linear ramp between."""
    factor = _required(scaling, "factor")
    original = _required(scaling, "original_max_position_embeddings")
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (original frequency), 0: interpolate
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def _required(scaling: dict, key: str):
    if scaling.get(key) is None:
        raise ValueError(f"rope_scaling: {key} is required for rope_type yarn")
    return scaling[key]


def _rope_type(scaling: dict | None) -> str | None:
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction, 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(scaling: dict | None) -> float:
    """What the cos/sin table is multiplied by: YaRN's attention factor (given, or
    mscale(factor, mscale) / mscale(factor, mscale_all_dim), or mscale(factor)); 1 otherwise."""
    if _rope_type(scaling) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = _required(scaling, "factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def softmax_scale_correction(scaling: dict | None) -> float:
    """DeepSeek's MLA multiplies its softmax scale by mscale(factor, mscale_all_dim) squared
    under rope scaling with `mscale_all_dim` (the no-rope channels get the correction too);
    1 otherwise."""
    if _rope_type(scaling) in (None, "default") or not scaling.get("mscale_all_dim"):
        return 1.0
    return yarn_mscale(_required(scaling, "factor"), scaling["mscale_all_dim"]) ** 2


class RotaryEmbedding(nn.Module):
    """Holds the cos/sin table; attention applies it (atom_kernels.ops.qk_norm_rope_store_)."""

    def __init__(
        self, head_dim: int, max_position: int, theta: float, scaling: dict | None = None
    ) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        factor = rope_attention_factor(scaling)
        if factor != 1.0:
            table = table * factor
        self.register_buffer("cos_sin_cache", table, persistent=False)

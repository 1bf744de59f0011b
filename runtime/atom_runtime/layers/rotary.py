"""Rotary position embedding with a precomputed cos/sin table, including Llama 3's frequency
scaling (`rope_type: llama3`)."""

from __future__ import annotations

import math

import torch
from torch import nn


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
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
    raise ValueError(f"rope_scaling: rope_type {rope_type!r} is not supported")


class RotaryEmbedding(nn.Module):
    """Holds the cos/sin table; attention applies it (atom_kernels.ops.qk_norm_rope_store_)."""

    def __init__(
        self, head_dim: int, max_position: int, theta: float, scaling: dict | None = None
    ) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        self.register_buffer(
            "cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False
        )

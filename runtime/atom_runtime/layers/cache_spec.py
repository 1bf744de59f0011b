"""What an attention layer keeps in the paged cache: its tensors, each one row per token, so the
memory planner sizes and allocates caches without knowing the attention kind.

Every cache tensor of a layer is `[num_blocks, block_size, *token_shape]`: K and V of the
KV heads for ordinary attention (`paged_kv_spec`), one latent row for multi-head latent
attention (`latent_spec`). The kind is a name both ends of a KV transfer compare, so an engine
refuses another's cache by name rather than by a shape that happens to fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

PAGED_KV = "kv"  # K and V per KV head
MLA_LATENT = "mla_latent"  # one [kv_lora_rank + qk_rope_head_dim] row per token, every head's


@dataclass(frozen=True)
class CacheTensorSpec:
    """One cache tensor of a layer: its name and the shape of one token's entry."""

    name: str
    token_shape: tuple[int, ...]
    dtype: torch.dtype | None = None  # None: the engine's dtype

    def resolved_dtype(self, default: torch.dtype) -> torch.dtype:
        return self.dtype or default

    def bytes_per_token(self, default: torch.dtype) -> int:
        elem = torch.empty((), dtype=self.resolved_dtype(default)).element_size()
        return math.prod(self.token_shape) * elem


@dataclass(frozen=True)
class KVCacheSpec:
    """A layer's cache: its kind (`PAGED_KV`, `MLA_LATENT`) and tensors, in a fixed order."""

    kind: str
    tensors: tuple[CacheTensorSpec, ...]

    def __post_init__(self) -> None:
        if not self.tensors:
            raise ValueError(f"cache spec {self.kind!r} has no tensors")

    def bytes_per_token(self, default: torch.dtype) -> int:
        return sum(t.bytes_per_token(default) for t in self.tensors)

    def allocate(
        self,
        num_blocks: int,
        block_size: int,
        default: torch.dtype,
        device: torch.device,
        zeroed: bool = False,
    ) -> list[torch.Tensor]:
        """One `[num_blocks, block_size, *token_shape]` tensor per spec tensor: zeros when
        `zeroed`, else uninitialised."""
        make = torch.zeros if zeroed else torch.empty
        return [
            make((num_blocks, block_size, *t.token_shape), dtype=t.resolved_dtype(default),
                 device=device)
            for t in self.tensors
        ]  # fmt: skip


def paged_kv_spec(
    num_kv_heads: int, head_dim: int, dtype: torch.dtype | None = None
) -> KVCacheSpec:
    """K and V per KV head; `dtype` None keeps them in the engine's dtype (an FP8 cache sets
    its format here, and the memory planner sizes and allocates from it)."""
    token = (num_kv_heads, head_dim)
    return KVCacheSpec(
        PAGED_KV, (CacheTensorSpec("k", token, dtype), CacheTensorSpec("v", token, dtype))
    )


def latent_spec(kv_lora_rank: int, rope_dim: int) -> KVCacheSpec:
    return KVCacheSpec(MLA_LATENT, (CacheTensorSpec("latent", (kv_lora_rank + rope_dim,)),))

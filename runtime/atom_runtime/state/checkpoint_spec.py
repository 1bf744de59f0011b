"""The geometry of state checkpoints (contract 6): how many bytes one checkpoint holds and how many
KV-pool PAGE units it borrows. Derived once from the pool plan, frozen, handed to the scheduler.

A hybrid model's KV pool is a grid of blocks; one block id owns `page_unit_bytes` bytes (its K and
V rows in every attention layer). A request's recurrent state (the conv window and the recurrent
matrix of every stateful layer) is its *image*, `image_bytes` long. A checkpoint borrows
`units_per_image = ceil(image_bytes / page_unit_bytes)` blocks from the KV pool and keeps the image
in them, so checkpoints and live KV share one budget instead of a separate, idle reservation.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch


def _positive_int(field: str, value: object) -> int:
    # bool is an int subclass; True would silently mean 1 byte.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{field}: must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{field}: must be >= 1, got {value}")
    return value


def _dtype(field: str, value: object) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        dtype = getattr(torch, value, None)
        if isinstance(dtype, torch.dtype):
            return dtype
    raise ValueError(f"{field}: not a torch dtype: {value!r}")


@dataclass(frozen=True)
class PagedStateCheckpointSpec:
    """page_unit_bytes: bytes one KV block id owns in the pool (the unit checkpoints borrow).
    slot_bytes: bytes one Active Slot occupies in the state slot pool (>= image_bytes; a slot pool
    may pad a slot for alignment). image_bytes: bytes of state a checkpoint must keep.
    layout_id: names the byte layout, so an image is never restored into a different one."""

    page_unit_bytes: int
    slot_bytes: int
    image_bytes: int
    layout_id: str

    def __post_init__(self) -> None:
        _positive_int("page_unit_bytes", self.page_unit_bytes)
        _positive_int("slot_bytes", self.slot_bytes)
        _positive_int("image_bytes", self.image_bytes)
        if self.image_bytes > self.slot_bytes:
            raise ValueError(
                f"image_bytes: {self.image_bytes} exceeds slot_bytes {self.slot_bytes} "
                "(a slot must hold the whole image)"
            )
        if not isinstance(self.layout_id, str) or not self.layout_id:
            raise ValueError(f"layout_id: must be a non-empty string, got {self.layout_id!r}")

    @property
    def units_per_image(self) -> int:
        return -(-self.image_bytes // self.page_unit_bytes)

    @property
    def padded_image_bytes(self) -> int:
        """Bytes a checkpoint occupies in the pool; the tail past image_bytes is never read."""
        return self.units_per_image * self.page_unit_bytes

    @classmethod
    def from_plan(cls, plan: StatePoolPlan) -> PagedStateCheckpointSpec:
        image = plan.image_bytes
        return cls(
            page_unit_bytes=plan.kv_block_bytes,
            slot_bytes=image,
            image_bytes=image,
            layout_id=plan.layout_id,
        )


@dataclass(frozen=True)
class StateTensorShape:
    """One per-slot state tensor of one stateful layer: its shape without the slot dimension."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name: must be a non-empty string, got {self.name!r}")
        if not isinstance(self.shape, tuple) or not self.shape:
            raise ValueError(f"{self.name}.shape: must be a non-empty tuple, got {self.shape!r}")
        for i, d in enumerate(self.shape):
            _positive_int(f"{self.name}.shape[{i}]", d)
        object.__setattr__(self, "dtype", _dtype(f"{self.name}.dtype", self.dtype))

    @property
    def nbytes(self) -> int:
        n = torch.empty((), dtype=self.dtype).element_size()
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class StatePoolPlan:
    """What the engine decided about memory: the KV pool's block geometry (attention layers only)
    and the per-slot state tensors, in the order the slot pool lays them out (that order is the
    order of bytes in a checkpoint image)."""

    block_size: int
    num_attention_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: torch.dtype
    state_tensors: tuple[StateTensorShape, ...]

    def __post_init__(self) -> None:
        _positive_int("block_size", self.block_size)
        _positive_int("num_attention_layers", self.num_attention_layers)
        _positive_int("num_kv_heads", self.num_kv_heads)
        _positive_int("head_dim", self.head_dim)
        object.__setattr__(self, "kv_dtype", _dtype("kv_dtype", self.kv_dtype))
        if not isinstance(self.state_tensors, tuple) or not self.state_tensors:
            raise ValueError("state_tensors: a hybrid model has at least one state tensor")
        for t in self.state_tensors:
            if not isinstance(t, StateTensorShape):
                raise ValueError(f"state_tensors: expected StateTensorShape, got {t!r}")
        names = [t.name for t in self.state_tensors]
        if len(set(names)) != len(names):
            raise ValueError(f"state_tensors: duplicate names in {names}")

    @property
    def kv_block_bytes(self) -> int:
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        return (
            2
            * self.num_attention_layers
            * self.block_size
            * self.num_kv_heads
            * self.head_dim
            * elem
        )

    @property
    def image_bytes(self) -> int:
        return sum(t.nbytes for t in self.state_tensors)

    @property
    def layout_id(self) -> str:
        """A digest of everything that fixes where a byte of state lives in an image and a unit."""
        parts = [
            f"kv:{self.block_size}x{self.num_attention_layers}x{self.num_kv_heads}x{self.head_dim}"
            f":{self.kv_dtype}"
        ]
        parts += [f"{t.name}:{'x'.join(map(str, t.shape))}:{t.dtype}" for t in self.state_tensors]
        return hashlib.sha256(";".join(parts).encode()).hexdigest()[:16]


def gated_deltanet_state_tensors(
    num_layers: int,
    conv_dim: int,
    conv_kernel: int,
    num_v_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    conv_dtype: torch.dtype | str,
    state_dtype: torch.dtype | str,
) -> tuple[StateTensorShape, ...]:
    """The state of Gated DeltaNet layers as the hybrid ops hold it, per layer: the conv window
    [conv_dim, conv_kernel - 1] then the recurrent matrix [num_v_heads, head_k_dim, head_v_dim]."""
    _positive_int("num_layers", num_layers)
    if not isinstance(conv_kernel, int) or isinstance(conv_kernel, bool) or conv_kernel < 2:
        raise ValueError(f"conv_kernel: must be an int >= 2, got {conv_kernel!r}")
    out: list[StateTensorShape] = []
    for i in range(num_layers):
        out.append(StateTensorShape(f"layer{i}.conv", (conv_dim, conv_kernel - 1), conv_dtype))
        out.append(
            StateTensorShape(
                f"layer{i}.recurrent", (num_v_heads, head_k_dim, head_v_dim), state_dtype
            )
        )
    return tuple(out)

"""A state checkpoint's record and the handles to it (contract 6): its lifecycle state, the
generation-checked reference readers hold, what staging and a lookup hand back. The store
(checkpoint_store.py) owns the records; everything here is plain data."""

from __future__ import annotations

import enum
from dataclasses import dataclass

OWNER_PREFIX = "state-ckpt"


class CheckpointState(enum.Enum):
    COPYING = "copying"
    READY = "ready"
    EVICTING = "evicting"


@dataclass(frozen=True)
class CheckpointRef:
    index: int
    generation: int


@dataclass(frozen=True)
class StagedCheckpoint:
    """A COPYING record and the pool blocks its image must be copied into."""

    ref: CheckpointRef
    units: tuple[int, ...]
    prefix_hash: int
    num_tokens: int


@dataclass(frozen=True)
class CheckpointHit:
    """The deepest READY checkpoint found for a prefix: resume at num_tokens from these units."""

    ref: CheckpointRef
    num_tokens: int
    units: tuple[int, ...]


class CheckpointRecord:
    __slots__ = (
        "index",
        "generation",
        "state",
        "prefix_hash",
        "num_tokens",
        "units",
        "pins",
        "demand",
        "rolling",
        "from_decode",
        "launched_in",
    )

    def __init__(self, index: int) -> None:
        self.index = index
        self.generation = 0
        self.state: CheckpointState | None = None  # None: a free slot of the record table
        self.prefix_hash = 0
        self.num_tokens = 0
        self.units: tuple[int, ...] = ()
        self.pins = 0
        self.demand = False
        self.rolling = False  # an unread decode anchor: only another decode anchor displaces it
        self.from_decode = False  # staged as a decode anchor (kept once read, unlike rolling)
        self.launched_in: int | None = None  # the batch whose launch carries the copy

    @property
    def ref(self) -> CheckpointRef:
        return CheckpointRef(self.index, self.generation)

    @property
    def owner(self) -> str:
        # The generation is part of the owner tag: blocks lent to an earlier life of this slot
        # can never be taken back in its name.
        return f"{OWNER_PREFIX}:{self.index}.{self.generation}"

    def __repr__(self) -> str:
        state = self.state.value if self.state else "free"
        return (
            f"CheckpointRecord({self.index}.{self.generation}, {state}, "
            f"tokens={self.num_tokens}, pins={self.pins}, units={list(self.units)})"
        )


def require_int(field: str, value: object, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{field}: must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{field}: must be >= {minimum}, got {value}")
    return value

"""KV-cache events on the wire (contract 4, docs/architecture.md): vLLM's layout, so existing
routers read them unchanged.

A payload is one msgpack `EventBatch` array `[ts, events, data_parallel_rank]`. Each event is a
tagged positional array whose first element is the class name, then the fields in vLLM's order:

    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]

Every field is always written (no `omit_defaults`): decoders that read fixed positions (llm-d's Go
structs) never meet a short array. Block hashes are unsigned 64-bit ints; msgspec writes any
non-negative int with msgpack's uint family, so a hash above 2**63 - 1 goes out as uint64.

The constructors check their types (contract 5): msgpack cannot encode an `array("i")`, so handing
one over must fail here, in the engine's frame, and not later in the publisher's thread.

`decode_batch` is the tolerant reader for subscribers: it also accepts vLLM's newer map-shaped
events (`{"type": "BlockStored", ...}`), a map-shaped batch, trailing fields it does not know, and
hashes sent as bytes or as signed int64.
"""

from __future__ import annotations

from typing import Any

import msgspec

MEDIUM_GPU = "GPU"
UINT64_MAX = (1 << 64) - 1


class KVEventDecodeError(ValueError):
    """A payload that is not a KV event batch in any layout we accept."""


def _check_hash(cls: str, field: str, value: object) -> None:
    if type(value) is not int:
        raise TypeError(f"{cls}.{field}: block hash must be int, got {type(value).__name__}")
    if not 0 <= value <= UINT64_MAX:
        raise ValueError(f"{cls}.{field}: block hash {value} is not an unsigned 64-bit int")


def _check_hash_list(cls: str, field: str, value: object) -> None:
    if type(value) is not list:
        raise TypeError(f"{cls}.{field} must be a list, got {type(value).__name__}")
    for h in value:
        _check_hash(cls, field, h)


def _check_optional(cls: str, field: str, value: object, kind: type) -> None:
    if value is not None and type(value) is not kind:
        raise TypeError(
            f"{cls}.{field} must be {kind.__name__} or None, got {type(value).__name__}"
        )


class KVCacheEvent(msgspec.Struct, array_like=True, tag=True, gc=False):
    """Base of the three events; the msgpack tag is the subclass name."""


class BlockStored(KVCacheEvent):
    """Full blocks whose KV was computed and is now cached, in chain order."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None

    def __post_init__(self) -> None:
        _check_hash_list("BlockStored", "block_hashes", self.block_hashes)
        if self.parent_block_hash is not None:
            _check_hash("BlockStored", "parent_block_hash", self.parent_block_hash)
        if type(self.token_ids) is not list:
            raise TypeError(
                f"BlockStored.token_ids must be a list, got {type(self.token_ids).__name__} "
                "(convert an array('i') with .tolist() before building the event)"
            )
        if type(self.block_size) is not int or self.block_size <= 0:
            raise ValueError(
                f"BlockStored.block_size must be a positive int, got {self.block_size!r}"
            )
        # Empty: an engine publishing hashes only (include_token_ids false).
        if self.token_ids and len(self.token_ids) != len(self.block_hashes) * self.block_size:
            raise ValueError(
                f"BlockStored.token_ids has {len(self.token_ids)} tokens; "
                f"{len(self.block_hashes)} blocks of {self.block_size} need "
                f"{len(self.block_hashes) * self.block_size}"
            )
        _check_optional("BlockStored", "lora_id", self.lora_id, int)
        _check_optional("BlockStored", "medium", self.medium, str)
        _check_optional("BlockStored", "lora_name", self.lora_name, str)


class BlockRemoved(KVCacheEvent):
    """Blocks evicted from the cache; their hashes are no longer served."""

    block_hashes: list[int]
    medium: str | None = MEDIUM_GPU

    def __post_init__(self) -> None:
        _check_hash_list("BlockRemoved", "block_hashes", self.block_hashes)
        _check_optional("BlockRemoved", "medium", self.medium, str)


class AllBlocksCleared(KVCacheEvent):
    """The whole prefix cache was reset."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
EVENT_TYPES: dict[str, type[KVCacheEvent]] = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    """One engine step's events (vLLM's `KVEventBatch`): `[ts, events, data_parallel_rank]`."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None

    def __post_init__(self) -> None:
        if type(self.events) is not list:
            raise TypeError(f"EventBatch.events must be a list, got {type(self.events).__name__}")
        _check_optional("EventBatch", "data_parallel_rank", self.data_parallel_rank, int)


_encoder = msgspec.msgpack.Encoder()
_strict_decoder = msgspec.msgpack.Decoder(EventBatch)
_any_decoder = msgspec.msgpack.Decoder()


def encode_batch(batch: EventBatch) -> bytes:
    """The msgpack payload of one batch, as the publisher sends it."""
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> EventBatch:
    """Decode a payload in our layout or any layout vLLM has published; raises KVEventDecodeError."""
    try:
        return _strict_decoder.decode(payload)
    except (msgspec.DecodeError, TypeError, ValueError):
        pass  # not our exact layout: take the tolerant path below
    try:
        raw = _any_decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise KVEventDecodeError(f"payload is not msgpack: {exc}") from exc
    try:
        return _batch_from_raw(raw)
    except (TypeError, ValueError, KeyError, IndexError) as exc:
        raise KVEventDecodeError(f"payload is not a KV event batch: {exc}") from exc


def _hash_from_wire(value: Any) -> int:
    # vLLM has sent hashes as signed int64 (Python's hash()) and as bytes (sha256 digests); read
    # both the way llm-d does: two's complement for ints, the last 8 bytes big-endian for bytes.
    if type(value) is int:
        return value & UINT64_MAX
    if isinstance(value, bytes | bytearray):
        if not value:
            raise ValueError("empty block hash")
        return int.from_bytes(bytes(value[-8:]), "big")
    raise TypeError(f"block hash of type {type(value).__name__}")


def _event_from_raw(raw: Any) -> KVCacheEvent:
    if isinstance(raw, list):
        if not raw or not isinstance(raw[0], str):
            raise ValueError(f"event array without a tag: {raw!r:.80}")
        cls = EVENT_TYPES.get(raw[0])
        if cls is None:
            raise ValueError(f"unknown event tag {raw[0]!r}")
        names = cls.__struct_fields__
        fields = dict(zip(names, raw[1 : 1 + len(names)], strict=False))
    elif isinstance(raw, dict):
        cls = EVENT_TYPES.get(raw.get("type"))  # type: ignore[arg-type]
        if cls is None:
            raise ValueError(f"unknown event type {raw.get('type')!r}")
        fields = {name: raw[name] for name in cls.__struct_fields__ if name in raw}
    else:
        raise TypeError(f"event must be an array or a map, got {type(raw).__name__}")
    if "block_hashes" in fields:
        fields["block_hashes"] = [_hash_from_wire(h) for h in fields["block_hashes"]]
    if fields.get("parent_block_hash") is not None:
        fields["parent_block_hash"] = _hash_from_wire(fields["parent_block_hash"])
    return cls(**fields)


def _batch_from_raw(raw: Any) -> EventBatch:
    if isinstance(raw, list):
        if len(raw) < 2:
            raise ValueError(f"batch array has {len(raw)} elements, needs at least 2")
        ts, events = raw[0], raw[1]
        rank = raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict):
        ts, events, rank = raw["ts"], raw["events"], raw.get("data_parallel_rank")
    else:
        raise TypeError(f"batch must be an array or a map, got {type(raw).__name__}")
    if type(ts) not in (int, float):
        raise TypeError(f"batch ts must be a number, got {type(ts).__name__}")
    if not isinstance(events, list):
        raise TypeError(f"batch events must be an array, got {type(events).__name__}")
    return EventBatch(float(ts), [_event_from_raw(e) for e in events], rank)

"""KV-cache events: vLLM's wire format, a never-blocking publisher, a gap-filling subscriber.

Engine side: `make_publisher(KVEventsConfig.from_cli(...), dp_rank)`, then `publish(events)` once
per step and `raise_if_failed()`. Router side: `KVEventSubscriber` feeding a `PrefixIndex`.
See docs/kv-events.md.
"""

from atom_runtime.kv_events.config import KVEventsConfig, KVEventsConfigError
from atom_runtime.kv_events.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVCacheEvent,
    KVEventDecodeError,
    decode_batch,
    encode_batch,
)
from atom_runtime.kv_events.index import PrefixIndex
from atom_runtime.kv_events.publisher import (
    EventPublisher,
    KVEventPublisherError,
    NullEventPublisher,
    ZmqEventPublisher,
    make_publisher,
)
from atom_runtime.kv_events.subscriber import KVEventSubscriber

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "EventPublisher",
    "KVCacheEvent",
    "KVEventDecodeError",
    "KVEventPublisherError",
    "KVEventSubscriber",
    "KVEventsConfig",
    "KVEventsConfigError",
    "NullEventPublisher",
    "PrefixIndex",
    "ZmqEventPublisher",
    "decode_batch",
    "encode_batch",
    "make_publisher",
]

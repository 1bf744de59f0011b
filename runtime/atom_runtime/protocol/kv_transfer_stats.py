"""KV transfer counters, pushed from the engine core with its EngineStats (a wire struct)."""

from __future__ import annotations

import msgspec


class KVTransferStats(msgspec.Struct, array_like=True):
    held_blocks: int = 0  # producer: blocks held for pulls right now
    holds_released: int = 0  # producer: holds the consumer released, cumulative
    hold_timeouts: int = 0  # producer: holds that expired unreleased, cumulative
    blocks_sent: int = 0
    bytes_sent: int = 0
    pulls_in_flight: int = 0  # consumer
    pulls_ok: int = 0
    blocks_received: int = 0
    bytes_received: int = 0
    blocks_local_hit: int = 0  # consumer: blocks it already had (not pulled)
    fallbacks: int = 0  # consumer: requests prefilled locally after a failed/timed-out pull
    holds_refused: int = 0  # producer: finished prompts not held (holds at max_held_fraction)

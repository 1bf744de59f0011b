"""The checkpoint parts one engine shares (docs/state-checkpoints.md, "In the engine"): the
store, the per-batch maintenance queue, placement and their counters, built once at start-up
from the runner's spec and handed to the scheduler."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from atom_runtime.core.block_pool import BlockPool
from atom_runtime.protocol.checkpoint_counters import StateCheckpointCounters
from atom_runtime.state.checkpoint_spec import PagedStateCheckpointSpec
from atom_runtime.state.checkpoint_store import StateCheckpointStore
from atom_runtime.state.maintenance import StateMaintenance
from atom_runtime.state.placement import CheckpointPlacement

log = logging.getLogger(__name__)


class EngineCheckpoints:
    def __init__(
        self,
        pool: BlockPool,
        spec: PagedStateCheckpointSpec,
        num_slots: int,
        interval_tokens: int,
        demand: bool | None,
        *,
        max_units: int | None = None,
        min_free_blocks: int | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.spec = spec
        self.num_slots = num_slots
        self.counters = StateCheckpointCounters()
        self.placement = CheckpointPlacement(
            interval_tokens, pool.block_size, demand, counters=self.counters, environ=environ
        )
        self.store = StateCheckpointStore(
            pool,
            spec,
            max_units=max_units,
            min_free_blocks=min_free_blocks,
            counters=self.counters,
        )
        self.maint = StateMaintenance(self.store)
        log.info(
            "state checkpoints: interval %s, demand rungs %s; one image is %d KV blocks "
            "(%.2f MiB), at most %d blocks of %d hold checkpoints",
            "anchors only" if self.placement.spacing < 0 else f"{self.placement.spacing} tokens",
            "on" if self.placement.demand_enabled else "off",
            spec.units_per_image,
            spec.image_bytes / 2**20,
            self.store.max_units,
            pool.num_blocks,
        )

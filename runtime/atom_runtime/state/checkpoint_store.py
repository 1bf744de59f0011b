"""The state checkpoint store (contract 6): which request-state images are kept, in which KV-pool
blocks, and who is reading them. It never touches tensors; copies are queued by `maintenance.py`.

A record lives COPYING -> READY -> (EVICTING) -> freed:

- `stage` borrows `units_per_image` blocks from the KV pool (`BlockPool.lend`, all or nothing) and
  makes a COPYING record. Its prefix hash is claimed (no second copy of the same prefix starts) but
  it is not visible to `lookup`: the bytes are not there yet.
- `launch(ref, batch)` notes the batch whose byte-copy launch carries the copy; `publish(batch)`,
  called once that batch has run, turns its COPYING records READY and visible (two-phase
  publication: visibility follows a copy that really ran, never one that was only queued).
- Readers (`acquire`/`release`) pin a READY record; a pinned record is never freed. Unpinned READY
  records are evicted whole, least recently used first; demand records enter at the LRU head.
- Unindexing a record that is being read or copied makes it EVICTING: invisible at once, its
  blocks returned when the last pin drops or its in-flight copy has run (counted as orphaned).

Slots in the record table are reused; a `CheckpointRef` carries the slot's generation, so a
reference to a record that has since been freed is detected (RuntimeError), never misread.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence

from atom_runtime.core.block_pool import BlockPool
from atom_runtime.protocol.checkpoint_counters import StateCheckpointCounters
from atom_runtime.state.checkpoint_record import (
    OWNER_PREFIX,
    CheckpointHit,
    CheckpointRecord,
    CheckpointRef,
    CheckpointState,
    StagedCheckpoint,
    require_int,
)
from atom_runtime.state.checkpoint_spec import PagedStateCheckpointSpec

log = logging.getLogger(__name__)


class StateCheckpointStore:
    def __init__(
        self,
        pool: BlockPool,
        spec: PagedStateCheckpointSpec,
        *,
        max_units: int | None = None,
        min_free_blocks: int | None = None,
        counters: StateCheckpointCounters | None = None,
    ) -> None:
        if not isinstance(spec, PagedStateCheckpointSpec):
            raise TypeError(f"spec: expected PagedStateCheckpointSpec, got {type(spec).__name__}")
        self.pool = pool
        self.spec = spec
        self.block_size = pool.block_size
        self.units_per_image = spec.units_per_image
        # At most a tenth of the pool holds checkpoints unless told otherwise; the target the
        # multi-turn benchmark holds us to.
        self.max_units = require_int(
            "max_units", pool.num_blocks // 10 if max_units is None else max_units, 0
        )
        # The watermark: a checkpoint is never staged if it would leave the pool with fewer free
        # blocks than this, so live KV keeps room to grow without first reclaiming checkpoints.
        self.min_free_blocks = require_int(
            "min_free_blocks",
            pool.num_blocks // 20 if min_free_blocks is None else min_free_blocks,
            0,
        )
        self.counters = counters if counters is not None else StateCheckpointCounters()
        self.counters.pool_units = pool.num_blocks
        self._records: list[CheckpointRecord] = []
        self._free_indexes: list[int] = []
        # Prefix hash -> its COPYING or READY record: one record per hash; only READY is visible.
        self._by_hash: dict[int, CheckpointRecord] = {}
        # READY records by record index, next to evict first.
        self._lru: OrderedDict[int, None] = OrderedDict()
        # Batch id -> records whose copy rides that batch's launch.
        self._launched: dict[int, list[CheckpointRecord]] = {}
        self.units_in_use = 0
        if not self.can_ever_store:
            log.warning(
                "state checkpoints can never be stored: one image needs %d KV blocks but at most "
                "%d may hold checkpoints (and %d must stay free of %d); prefix reuse of hybrid "
                "models is off. Raise the pool size (--gpu-memory-utilization) or "
                "--state-checkpoint-memory-fraction.",
                self.units_per_image,
                self.max_units,
                self.min_free_blocks,
                pool.num_blocks,
            )

    # -- facts ---------------------------------------------------------------------------------

    @property
    def can_ever_store(self) -> bool:
        return (
            self.units_per_image <= self.max_units
            and self.units_per_image + self.min_free_blocks <= self.pool.num_blocks
        )

    @property
    def num_records(self) -> int:
        return sum(1 for r in self._records if r.state is not None)

    @property
    def num_ready(self) -> int:
        return len(self._lru)

    @property
    def total_pins(self) -> int:
        return sum(r.pins for r in self._records if r.state is not None)

    def state_of(self, ref: CheckpointRef) -> CheckpointState | None:
        """The record's state, or None when the reference no longer names a live record."""
        rec = self._find(ref)
        return rec.state if rec is not None else None

    def from_decode(self, ref: CheckpointRef) -> bool:
        """True when ref's record was staged as a decode anchor: the end of some request's
        answer, which the conversation's next turn moves past."""
        rec = self._find(ref)
        return rec is not None and rec.from_decode

    def pins_of(self, ref: CheckpointRef) -> int:
        """Readers pinning the record; 0 when the reference no longer names a live record."""
        rec = self._find(ref)
        return rec.pins if rec is not None else 0

    # -- staging and publication ---------------------------------------------------------------

    def stage(
        self,
        prefix_hash: int,
        num_tokens: int,
        *,
        demand: bool = False,
        rolling: bool = False,
    ) -> StagedCheckpoint | None:
        """Borrow blocks for a checkpoint of the prefix ending at num_tokens (a block boundary,
        prefix_hash the chained hash of its last block). None when that prefix is already stored
        or being stored, or when there is no room (counted as dropped). demand: speculative, it
        enters the LRU at its head. rolling (a decode anchor): it makes room only by evicting
        other decode anchors nobody has read, so a store that is full does not trade its anchors,
        rungs and demand rungs for the text being generated."""
        require_int("prefix_hash", prefix_hash, 0)
        require_int("num_tokens", num_tokens, 1)
        if num_tokens % self.block_size:
            raise ValueError(
                f"num_tokens: a checkpoint sits on a block boundary (block size "
                f"{self.block_size}), got {num_tokens}"
            )
        if prefix_hash in self._by_hash:
            return None
        if not self._make_room(self.units_per_image, rolling_only=rolling):
            self.counters.dropped += 1
            return None
        rec = self._new_record()
        rec.state = CheckpointState.COPYING
        rec.prefix_hash = prefix_hash
        rec.num_tokens = num_tokens
        rec.demand = demand
        rec.rolling = rec.from_decode = rolling
        rec.units = tuple(self.pool.lend(self.units_per_image, rec.owner))
        self._by_hash[prefix_hash] = rec
        self._add_units(len(rec.units))
        return StagedCheckpoint(rec.ref, rec.units, prefix_hash, num_tokens)

    def find(self, prefix_hash: int) -> CheckpointRef | None:
        """The COPYING or READY record of this prefix, if any (a KV-transfer producer holds the
        one its consumer resumes from: READY once the batch carrying its copy has run)."""
        rec = self._by_hash.get(prefix_hash)
        return rec.ref if rec is not None else None

    def units_of(self, ref: CheckpointRef) -> tuple[int, ...]:
        return self._require(ref, "read its units").units

    def publish_received(self, ref: CheckpointRef) -> None:
        """A staged record whose image arrived by KV transfer (written into its units by the
        transport, no batch copy): READY and visible now."""
        rec = self._require(ref, "publish a received image")
        if rec.state is not CheckpointState.COPYING or rec.launched_in is not None:
            raise RuntimeError(f"state checkpoint {rec!r}: only a staged record can be received")
        rec.state = CheckpointState.READY
        self._lru[rec.index] = None
        self.counters.stored += 1

    def is_pending_copy(self, ref: CheckpointRef) -> bool:
        """True while ref is a COPYING record whose copy no launch carries yet."""
        rec = self._find(ref)
        return rec is not None and rec.state is CheckpointState.COPYING and rec.launched_in is None

    def launch(self, ref: CheckpointRef, batch_id: int) -> None:
        """The copy into ref's blocks rides batch_id's launch; publish(batch_id) follows it."""
        rec = self._require(ref, "launch its copy")
        if rec.state is not CheckpointState.COPYING or rec.launched_in is not None:
            raise RuntimeError(f"state checkpoint {rec!r}: only a queued copy can be launched")
        rec.launched_in = batch_id
        self._launched.setdefault(batch_id, []).append(rec)

    def publish(self, batch_id: int) -> list[CheckpointRef]:
        """batch_id has run: its copies are complete. COPYING records become READY and visible;
        ones unindexed meanwhile are freed now (orphaned), never leaked."""
        published = []
        for rec in self._launched.pop(batch_id, ()):
            if rec.state is CheckpointState.COPYING:
                rec.state = CheckpointState.READY
                rec.launched_in = None
                self._lru[rec.index] = None
                if rec.demand:
                    # Speculative: first to go unless a reader proves it useful.
                    self._lru.move_to_end(rec.index, last=False)
                self.counters.stored += 1
                published.append(rec.ref)
            else:  # EVICTING: unindexed while its copy was in flight
                rec.launched_in = None
                self.counters.orphaned += 1
                if rec.pins == 0:
                    self._free_record(rec)
        return published

    def cancel(self, ref: CheckpointRef) -> bool:
        """Give up a COPYING record: its blocks go back now, or, if a launch already carries the
        copy, once that batch has run. False when ref no longer names a COPYING record."""
        rec = self._find(ref)
        if rec is None or rec.state is not CheckpointState.COPYING:
            return False
        self.counters.dropped += 1
        if rec.launched_in is None:
            self._free_record(rec)
        else:
            self._unindex(rec)
            rec.state = CheckpointState.EVICTING
        return True

    def supersede(self, ref: CheckpointRef) -> None:
        """A newer checkpoint of the same sequence replaces ref (a rolling decode anchor): a
        READY record is evicted now, or once its last reader unpins it; a COPYING one is
        cancelled. Nothing happens when ref names no live record any more."""
        rec = self._find(ref)
        if rec is None:
            return
        if rec.state is CheckpointState.COPYING:
            self.cancel(ref)
        elif rec.state is CheckpointState.READY:
            self._evict_ready(rec)

    # -- readers -------------------------------------------------------------------------------

    def lookup(self, block_hashes: Sequence[int], max_blocks: int) -> CheckpointHit | None:
        """The deepest READY checkpoint at or below max_blocks full blocks of this prefix. Pins
        nothing: `acquire` the hit before queuing a restore."""
        for k in range(min(max_blocks, len(block_hashes)), 0, -1):
            rec = self._by_hash.get(block_hashes[k - 1])
            if (
                rec is not None
                and rec.state is CheckpointState.READY
                and rec.num_tokens == k * self.block_size
            ):
                return CheckpointHit(rec.ref, rec.num_tokens, rec.units)
        return None

    def acquire(self, ref: CheckpointRef) -> tuple[int, ...]:
        """Pin a READY record for a reader; returns its units."""
        rec = self._find(ref)
        if rec is None or rec.state is not CheckpointState.READY:
            raise RuntimeError(
                f"state checkpoint {ref.index}.{ref.generation} vanished before it was pinned "
                f"(now {rec!r}); look it up again"
            )
        rec.pins += 1
        rec.demand = rec.rolling = (
            False  # a speculative one that served a reader has earned its place
        )
        self._lru.move_to_end(rec.index)
        return rec.units

    def release(self, ref: CheckpointRef) -> None:
        """Drop one reader pin; an EVICTING record is freed with its last pin."""
        rec = self._require(ref, "drop a pin")
        if rec.pins <= 0:
            raise RuntimeError(f"state checkpoint {rec!r}: pin dropped more often than taken")
        rec.pins -= 1
        if rec.pins == 0 and rec.state is CheckpointState.EVICTING and rec.launched_in is None:
            self._free_record(rec)

    # -- giving blocks back --------------------------------------------------------------------

    def reclaim(self, num_blocks: int) -> int:
        """Free checkpoints until num_blocks blocks went back to the pool (live KV needs them):
        unpinned READY records LRU first, then copies not yet launched. Returns the blocks
        returned, which may be fewer (pinned and in-flight records stay)."""
        require_int("num_blocks", num_blocks, 0)
        returned = 0
        for index in list(self._lru):
            if returned >= num_blocks:
                return returned
            rec = self._records[index]
            if rec.pins == 0:
                returned += len(rec.units)
                self.counters.evicted += 1
                self._free_record(rec)
        for rec in list(self._by_hash.values()):
            if returned >= num_blocks:
                break
            if rec.state is CheckpointState.COPYING and rec.launched_in is None:
                returned += len(rec.units)
                self.cancel(rec.ref)
        return returned

    def invalidate_all(self) -> bool:
        """Unindex every record (a prefix-cache reset): free what can be freed now; pinned or
        in-flight records turn EVICTING and free themselves later. True when nothing is lent."""
        for rec in list(self._by_hash.values()):
            if rec.state is CheckpointState.READY:
                self._evict_ready(rec)
            else:
                self.cancel(rec.ref)
        return self.units_in_use == 0

    def _evict_ready(self, rec) -> None:
        """A READY record leaves the index: freed now, or by its last unpin while pinned."""
        self.counters.evicted += 1
        if rec.pins == 0:
            self._free_record(rec)
        else:
            self._unindex(rec)
            rec.state = CheckpointState.EVICTING

    # -- invariants ----------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise RuntimeError naming the first broken invariant (tests, debug runs)."""
        live = [r for r in self._records if r.state is not None]
        lent_to_us = {b: o for b, o in self.pool.lent.items() if o.startswith(OWNER_PREFIX + ":")}
        units = [u for r in live for u in r.units]
        if len(units) != len(set(units)):
            raise RuntimeError("a pool block is held by two checkpoint records")
        if len(units) != self.units_in_use or self.units_in_use != len(lent_to_us):
            raise RuntimeError(
                f"units accounted {self.units_in_use}, held by records {len(units)}, "
                f"lent by the pool {len(lent_to_us)}"
            )
        if self.counters.units_in_use != self.units_in_use:
            raise RuntimeError("units_in_use gauge out of step with the store")
        for rec in live:
            if len(rec.units) != self.units_per_image:
                raise RuntimeError(f"{rec!r} holds a partial image")
            for u in rec.units:
                if lent_to_us.get(u) != rec.owner:
                    raise RuntimeError(f"{rec!r}: block {u} is not lent to it")
            if rec.pins < 0:
                raise RuntimeError(f"{rec!r}: negative pins")
            if rec.state is CheckpointState.COPYING and rec.pins:
                raise RuntimeError(f"{rec!r}: a COPYING record has readers")
            indexed = self._by_hash.get(rec.prefix_hash) is rec
            if rec.state is CheckpointState.EVICTING and indexed:
                raise RuntimeError(f"{rec!r}: EVICTING yet indexed")
            if rec.state is not CheckpointState.EVICTING and not indexed:
                raise RuntimeError(f"{rec!r}: live but not indexed")
            if (rec.state is CheckpointState.READY) != (rec.index in self._lru):
                raise RuntimeError(f"{rec!r}: LRU membership does not match READY")
            if rec.state is CheckpointState.READY and rec.launched_in is not None:
                raise RuntimeError(f"{rec!r}: READY with a copy in flight")
            if rec.state is CheckpointState.EVICTING and rec.pins == 0 and rec.launched_in is None:
                raise RuntimeError(f"{rec!r}: EVICTING with nothing to wait for (leaked)")
        for h, rec in self._by_hash.items():
            if rec.state is None or rec.prefix_hash != h:
                raise RuntimeError(f"index entry {h} points at {rec!r}")
        for batch_id, recs in self._launched.items():
            for rec in recs:
                if rec.launched_in != batch_id or rec.state is None:
                    raise RuntimeError(f"{rec!r} listed as launched in batch {batch_id}")

    # -- internals -----------------------------------------------------------------------------

    def _find(self, ref: CheckpointRef) -> CheckpointRecord | None:
        if not isinstance(ref, CheckpointRef):
            raise TypeError(f"ref: expected CheckpointRef, got {type(ref).__name__}")
        if not 0 <= ref.index < len(self._records):
            return None
        rec = self._records[ref.index]
        if rec.state is None or rec.generation != ref.generation:
            return None
        return rec

    def _require(self, ref: CheckpointRef, action: str) -> CheckpointRecord:
        rec = self._find(ref)
        if rec is None:
            raise RuntimeError(
                f"state checkpoint {ref.index}.{ref.generation} vanished: cannot {action} "
                "(it was freed while still referenced)"
            )
        return rec

    def _new_record(self) -> CheckpointRecord:
        if self._free_indexes:
            return self._records[self._free_indexes.pop()]
        rec = CheckpointRecord(len(self._records))
        self._records.append(rec)
        return rec

    def _make_room(self, need: int, rolling_only: bool = False) -> bool:
        """Evict unpinned READY records (LRU first; with rolling_only, only decode anchors no
        reader has used) until need more units fit under the cap and above the pool watermark.
        Evicts nothing when even evicting all of them would not do."""

        def short(freed: int) -> int:
            over_cap = self.units_in_use - freed + need - self.max_units
            under_watermark = self.min_free_blocks - (self.pool.num_free_blocks + freed - need)
            return max(over_cap, under_watermark, 0)

        evictable = [
            i
            for i in self._lru
            if self._records[i].pins == 0 and (self._records[i].rolling or not rolling_only)
        ]
        if short(len(evictable) * self.units_per_image) > 0:
            return False
        for index in evictable:
            if short(0) == 0:
                break
            self.counters.evicted += 1
            self._free_record(self._records[index])
        return short(0) == 0

    def _unindex(self, rec: CheckpointRecord) -> None:
        if self._by_hash.get(rec.prefix_hash) is rec:
            del self._by_hash[rec.prefix_hash]
        self._lru.pop(rec.index, None)

    def _free_record(self, rec: CheckpointRecord) -> None:
        strays = [u for u in rec.units if self.pool.lent.get(u) != rec.owner]
        if strays:
            raise RuntimeError(
                f"state checkpoint {rec!r}: blocks {strays} are not lent to it; refusing to take "
                "them back"
            )
        self.pool.take_back(list(rec.units))
        self._add_units(-len(rec.units))
        self._unindex(rec)
        rec.state = None
        rec.units = ()
        rec.pins = 0
        rec.demand = rec.rolling = rec.from_decode = False
        rec.launched_in = None
        rec.generation += 1
        self._free_indexes.append(rec.index)

    def _add_units(self, n: int) -> None:
        self.units_in_use += n
        self.counters.units_in_use = self.units_in_use

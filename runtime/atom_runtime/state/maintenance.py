"""Per-batch state maintenance (contract 6): the copies between Active Slots and checkpoint units
that must run before a batch's forward pass, queued by the scheduler and drained exactly once by
the batch that carries them.

Three kinds of op:
- store: a request's slot -> the units of a COPYING checkpoint (its state at a boundary the
  previous batch reached); published READY once the carrying batch has run.
- restore: the units of a READY checkpoint -> a request's slot (a prefix hit resuming there); the
  checkpoint stays pinned until the carrying batch has run.
- relocation: one slot -> another (the engine moves a request's Active Slot).

A batch's ops become one affine unit table, `(src unit, dst unit, n units)` rows in one address
space (pool blocks first, then each slot's image as `units_per_image` units), which one byte-copy
launch executes; `copy_units_reference` is the torch reference of that launch. Nothing here
decides policy: what to store and where to resume come from `placement.py` and the store.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from atom_runtime.state.checkpoint_record import CheckpointHit, CheckpointRef, StagedCheckpoint
from atom_runtime.state.checkpoint_spec import PagedStateCheckpointSpec
from atom_runtime.state.checkpoint_store import StateCheckpointStore


@dataclass(frozen=True)
class _SlotCopy:
    """A copy between a sequence's state slot and a checkpoint's pool units."""

    seq_id: str
    slot: int
    ref: CheckpointRef
    units: tuple[int, ...]


class StoreOp(_SlotCopy):
    """Slot -> checkpoint units."""


class RestoreOp(_SlotCopy):
    """Checkpoint units -> slot."""


@dataclass(frozen=True)
class RelocateOp:
    seq_id: str
    src_slot: int
    dst_slot: int


@dataclass(frozen=True)
class UnitCopyTable:
    """rows: int64 [R, 3] of (src unit, dst unit, n units); unit u < num_pool_units is pool block u,
    unit num_pool_units + s * units_per_image + k is unit k of slot s's image. Every row stays
    inside the pool or inside one slot image; no row reads a unit another row writes, and no
    unit is written twice, so the rows may run in any order (one launch)."""

    rows: torch.Tensor
    num_pool_units: int
    num_slots: int
    units_per_image: int
    page_unit_bytes: int

    @property
    def num_units(self) -> int:
        return int(self.rows[:, 2].sum()) if len(self.rows) else 0

    def padded(self, max_rows: int) -> torch.Tensor:
        """The rows in a fixed-size buffer (a CUDA graph replays one shape); padding rows copy
        nothing (n units 0)."""
        if len(self.rows) > max_rows:
            raise ValueError(f"max_rows: the table has {len(self.rows)} rows, more than {max_rows}")
        out = torch.zeros((max_rows, 3), dtype=torch.int64)
        out[: len(self.rows)] = self.rows
        return out


@dataclass(frozen=True)
class StateMaintenanceOps:
    """The ops one real batch carries, drained exactly once."""

    batch_id: int
    relocations: tuple[RelocateOp, ...]
    stores: tuple[StoreOp, ...]
    restores: tuple[RestoreOp, ...]

    def __bool__(self) -> bool:
        return bool(self.relocations or self.stores or self.restores)

    def unit_table(
        self, spec: PagedStateCheckpointSpec, num_pool_units: int, num_slots: int
    ) -> UnitCopyTable:
        return plan_unit_table(self, spec, num_pool_units, num_slots)


@dataclass(frozen=True)
class BatchOutcome:
    """What batch_done settled: checkpoints now READY, requests whose restore ran, and slots the
    engine may now give back to the slot pool."""

    published: list[CheckpointRef]
    restored: list[str]
    released_slots: list[int]


def plan_unit_table(
    ops: StateMaintenanceOps,
    spec: PagedStateCheckpointSpec,
    num_pool_units: int,
    num_slots: int,
) -> UnitCopyTable:
    """Turn a batch's ops into coalesced affine rows; raise RuntimeError on a read/write or
    write/write overlap between rows (they would race in one launch)."""
    per_image = spec.units_per_image

    def slot_unit(slot: int, k: int = 0) -> int:
        if not 0 <= slot < num_slots:
            raise ValueError(f"slot: {slot} outside the slot pool of {num_slots}")
        return num_pool_units + slot * per_image + k

    def pool_unit(u: int) -> int:
        if not 0 <= u < num_pool_units:
            raise ValueError(f"unit: {u} outside the KV pool of {num_pool_units} blocks")
        return u

    pairs: list[tuple[int, int]] = []  # (src unit, dst unit), one per unit copied
    for op in ops.relocations:
        pairs += [(slot_unit(op.src_slot, k), slot_unit(op.dst_slot, k)) for k in range(per_image)]
    for op in ops.stores:
        pairs += [(slot_unit(op.slot, k), pool_unit(u)) for k, u in enumerate(op.units)]
    for op in ops.restores:
        pairs += [(pool_unit(u), slot_unit(op.slot, k)) for k, u in enumerate(op.units)]

    writes = Counter(dst for _, dst in pairs)
    twice = sorted(u for u, n in writes.items() if n > 1)
    if twice:
        raise RuntimeError(f"state maintenance batch {ops.batch_id}: units {twice} written twice")
    raced = sorted({src for src, _ in pairs} & writes.keys())
    if raced:
        raise RuntimeError(
            f"state maintenance batch {ops.batch_id}: units {raced} are read and written by one "
            "launch"
        )

    rows: list[list[int]] = []
    for src, dst in pairs:
        last = rows[-1] if rows else None
        # Extend the previous run while both sides advance by one and the run stays inside the
        # pool or inside one slot image (so a row never straddles two regions of the space).
        if (
            last is not None
            and src == last[0] + last[2]
            and dst == last[1] + last[2]
            and _same_region(last[0], src, num_pool_units, per_image)
            and _same_region(last[1], dst, num_pool_units, per_image)
        ):
            last[2] += 1
        else:
            rows.append([src, dst, 1])
    table = torch.tensor(rows, dtype=torch.int64) if rows else torch.zeros((0, 3), torch.int64)
    return UnitCopyTable(table, num_pool_units, num_slots, per_image, spec.page_unit_bytes)


def _same_region(a: int, b: int, num_pool_units: int, per_image: int) -> bool:
    if a < num_pool_units or b < num_pool_units:
        return a < num_pool_units and b < num_pool_units
    return (a - num_pool_units) // per_image == (b - num_pool_units) // per_image


def uint8_rows(t: torch.Tensor) -> torch.Tensor:
    """A [rows, bytes] uint8 view sharing t's memory (rows = t's first dimension): how the KV
    pool's per-layer K/V tensors and the slot pool's per-layer state tensors are handed over."""
    if not t.is_contiguous():
        raise ValueError(f"tensor of shape {tuple(t.shape)} is not contiguous; no byte view")
    if t.dim() == 0:
        raise ValueError("a 0-d tensor has no rows")
    return t.reshape(-1).view(torch.uint8).view(t.shape[0], -1)


def copy_units_reference(
    table: UnitCopyTable,
    pool_segments: Sequence[torch.Tensor],
    slot_segments: Sequence[torch.Tensor],
    spec: PagedStateCheckpointSpec,
) -> None:
    """The torch reference of the byte-copy launch. A pool unit's bytes are its row in each pool
    segment, concatenated in order (e.g. layer 0 K, layer 0 V, layer 1 K, ...); a slot image's
    bytes are its row in each slot segment, concatenated (the plan's state tensor order), padded
    to whole units with bytes that are never written back."""
    p = spec.page_unit_bytes
    _check_segments("pool_segments", pool_segments, table.num_pool_units, p)
    _check_segments("slot_segments", slot_segments, table.num_slots, spec.image_bytes)
    if table.page_unit_bytes != p or table.units_per_image != spec.units_per_image:
        raise ValueError("table: planned for another checkpoint spec")
    base = table.num_pool_units
    per_image = spec.units_per_image

    def read(unit: int, n: int) -> torch.Tensor:
        if unit < base:
            return torch.cat([seg[unit : unit + n] for seg in pool_segments], dim=1).reshape(-1)
        slot, k = divmod(unit - base, per_image)
        image = torch.zeros(per_image * p, dtype=torch.uint8, device=slot_segments[0].device)
        image[: spec.image_bytes] = torch.cat([seg[slot] for seg in slot_segments])
        return image[k * p : (k + n) * p].clone()

    def write(unit: int, n: int, data: torch.Tensor) -> None:
        if unit < base:
            rows = data.view(n, p)
            offset = 0
            for seg in pool_segments:
                width = seg.shape[1]
                seg[unit : unit + n].copy_(rows[:, offset : offset + width])
                offset += width
            return
        slot, k = divmod(unit - base, per_image)
        lo, hi = k * p, min((k + n) * p, spec.image_bytes)
        offset = 0
        for seg in slot_segments:
            width = seg.shape[1]
            a, b = max(lo, offset), min(hi, offset + width)
            if a < b:
                seg[slot, a - offset : b - offset].copy_(data[a - lo : b - lo])
            offset += width

    # Rows never overlap (planned so), so reading all before writing any is one valid order.
    rows = table.rows.tolist()
    data = [read(src, n) for src, _, n in rows if n]
    for (_, dst, n), chunk in zip([r for r in rows if r[2]], data, strict=True):
        write(dst, n, chunk)


def _check_segments(name: str, segments: Sequence[torch.Tensor], rows: int, width: int) -> None:
    if not segments:
        raise ValueError(f"{name}: at least one segment")
    for i, seg in enumerate(segments):
        if seg.dtype != torch.uint8 or seg.dim() != 2 or seg.shape[0] != rows:
            raise ValueError(
                f"{name}[{i}]: expected a uint8 [{rows}, bytes] view (see uint8_rows), got "
                f"{seg.dtype} {tuple(seg.shape)}"
            )
    total = sum(seg.shape[1] for seg in segments)
    if total != width:
        raise ValueError(f"{name}: segments hold {total} bytes a row, the spec says {width}")


class StateMaintenance:
    """The queue between the scheduler (which decides ops) and the model runner (which launches
    them). Batch ids increase; `take_for_batch` drains only for a batch that really runs, and
    `batch_done` settles what that batch carried."""

    def __init__(self, store: StateCheckpointStore) -> None:
        self.store = store
        self._stores: list[tuple[int, StoreOp]] = []  # (after batch, op)
        self._restores: list[RestoreOp] = []
        self._relocations: list[RelocateOp] = []
        self._in_flight: dict[int, StateMaintenanceOps] = {}
        # Slot -> queued or in-flight ops that read or write it; a freed slot goes back to the
        # engine only once that count is zero.
        self._slot_refs: Counter[int] = Counter()
        self._released_pending: set[int] = set()
        # Slots freed up outside batch_done (a dropped stale copy); the next batch_done hands
        # them back.
        self._backlog: list[int] = []
        self._last_batch: int | None = None
        self._last_forward: int | None = None  # the last batch taken that runs sequences

    # -- queueing ------------------------------------------------------------------------------

    def queue_store(
        self, seq_id: str, slot: int, staged: StagedCheckpoint, after_batch: int
    ) -> StoreOp:
        """Copy seq's slot into a staged checkpoint once after_batch (the batch that brings the
        slot to the boundary) is behind: it rides the first real batch after it."""
        if not self.store.is_pending_copy(staged.ref):
            raise RuntimeError(f"state checkpoint {staged.ref}: not a queued copy (vanished?)")
        if self._last_forward is not None and after_batch < self._last_forward:
            # A later batch that runs sequences was already taken: it may have moved the slot
            # past the boundary, so the copy would capture the wrong state. (A flush, copies
            # alone, moves no slot.)
            raise RuntimeError(
                f"state checkpoint {staged.ref}: queued too late (after batch {after_batch}, "
                f"but batch {self._last_forward} is already taken); stage a boundary before "
                "taking the next batch"
            )
        op = StoreOp(seq_id, _slot(slot), staged.ref, staged.units)
        self._stores.append((after_batch, op))
        self._slot_refs[op.slot] += 1
        return op

    def queue_restore(self, seq_id: str, slot: int, hit: CheckpointHit) -> RestoreOp:
        """Gather a checkpoint into seq's slot on the next real batch. The caller pinned it with
        `store.acquire(hit.ref)` right after the lookup (before allocating KV, which may reclaim
        checkpoints); this op takes that pin over and drops it once the carrying batch has run,
        or when the request is freed first."""
        slot = _slot(slot)
        if any(r.slot == slot for r in self._restores):
            raise RuntimeError(f"slot {slot}: a restore into it is already queued")
        if self.store.pins_of(hit.ref) < 1:
            raise RuntimeError(
                f"state checkpoint {hit.ref.index}.{hit.ref.generation}: restore queued without "
                "a pin (acquire it right after the lookup), or it vanished"
            )
        op = RestoreOp(seq_id, slot, hit.ref, hit.units)
        self._restores.append(op)
        self._slot_refs[slot] += 1
        return op

    def queue_relocation(self, seq_id: str, src_slot: int, dst_slot: int) -> RelocateOp:
        """Move seq's state to dst_slot; src_slot is handed back (batch_done) once the move ran."""
        if _slot(src_slot) == _slot(dst_slot):
            raise ValueError(f"dst_slot: same as src_slot {src_slot}")
        op = RelocateOp(seq_id, src_slot, dst_slot)
        self._relocations.append(op)
        self._slot_refs[src_slot] += 1
        self._slot_refs[dst_slot] += 1
        self._released_pending.add(src_slot)
        return op

    # -- the batch boundary --------------------------------------------------------------------

    def take_for_batch(
        self, batch_id: int, num_scheduled: int, *, flush: bool = False
    ) -> StateMaintenanceOps | None:
        """The ops batch_id carries, drained exactly once; None when it carries none. A batch
        that schedules no sequence runs no launch: it drains nothing and unpins nothing, unless
        flush says the engine will run the launch alone (see `needs_flush`)."""
        if self._last_batch is not None and batch_id <= self._last_batch:
            raise ValueError(
                f"batch_id: {batch_id} is not after the last batch taken ({self._last_batch})"
            )
        self._last_batch = batch_id
        if num_scheduled > 0:
            self._last_forward = batch_id
        if num_scheduled <= 0 and not flush:
            return None
        stores, keep = [], []
        for after, op in self._stores:
            if after >= batch_id:
                keep.append((after, op))
            elif self.store.is_pending_copy(op.ref):
                self.store.launch(op.ref, batch_id)
                stores.append(op)
            else:  # cancelled or reclaimed while queued (already counted as dropped)
                self._backlog += self._unref(op.slot)
        self._stores = keep
        ops = StateMaintenanceOps(
            batch_id, tuple(self._relocations), tuple(stores), tuple(self._restores)
        )
        self._relocations, self._restores = [], []
        if not ops:
            return None
        self._in_flight[batch_id] = ops
        return ops

    def batch_done(self, batch_id: int) -> BatchOutcome:
        """batch_id has run: publish its stores, unpin its restores' sources, hand back slots
        nothing references any more."""
        ops = self._in_flight.pop(batch_id, None)
        published = self.store.publish(batch_id)
        restored: list[str] = []
        released, self._backlog = self._backlog, []
        if ops is not None:
            for op in ops.restores:
                self.store.release(op.ref)
                self.store.counters.restored += 1
                restored.append(op.seq_id)
                released += self._unref(op.slot)
            for op in ops.stores:
                released += self._unref(op.slot)
            for op in ops.relocations:
                released += self._unref(op.src_slot)
                released += self._unref(op.dst_slot)
        return BatchOutcome(published, restored, released)

    def free_request(self, seq_id: str, slot: int | None) -> list[int]:
        """seq is gone (finished, aborted, preempted). Cancels gathers aimed at its slot (dropping
        their pins) and its queued moves; returns the slots the engine may hand back now. A slot a
        queued or in-flight copy still reads comes back later, from batch_done."""
        released: list[int] = []
        if slot is not None:
            self._released_pending.add(_slot(slot))
        # Copies cancelled or reclaimed while queued no longer need the slot they read.
        keep_stores = []
        for after, op in self._stores:
            if self.store.is_pending_copy(op.ref):
                keep_stores.append((after, op))
            else:
                released += self._unref(op.slot)
        self._stores = keep_stores
        keep_restores = []
        for op in self._restores:
            if op.seq_id == seq_id or op.slot == slot:
                self.store.release(op.ref)
                released += self._unref(op.slot)
            else:
                keep_restores.append(op)
        self._restores = keep_restores
        keep_moves = []
        for op in self._relocations:
            if op.seq_id == seq_id:
                released += self._unref(op.src_slot)
                released += self._unref(op.dst_slot)
            else:
                keep_moves.append(op)
        self._relocations = keep_moves
        if slot is not None and self._slot_refs[slot] == 0 and slot in self._released_pending:
            self._released_pending.discard(slot)
            released.append(slot)
        return sorted(set(released))

    # -- facts ---------------------------------------------------------------------------------

    @property
    def needs_flush(self) -> bool:
        """True when slots are held by queued copies that no batch carries yet. With nothing to
        schedule (every slot held, say) no real batch would come to carry them and admission
        would wait forever: the engine then runs a maintenance-only launch (flush=True)."""
        return any(self._queued_refs(s) for s in self._released_pending)

    def _queued_refs(self, slot: int) -> bool:
        return (
            any(op.slot == slot for _, op in self._stores)
            or any(op.slot == slot for op in self._restores)
            or any(slot in (op.src_slot, op.dst_slot) for op in self._relocations)
        )

    @property
    def num_outstanding_restores(self) -> int:
        """Restores queued or in flight: each holds one pin on its checkpoint."""
        return len(self._restores) + sum(len(o.restores) for o in self._in_flight.values())

    @property
    def held_slots(self) -> set[int]:
        """Slots freed by their request and not handed back yet: a queued or in-flight copy
        still references them, or the next batch_done returns them."""
        return {s for s in self._released_pending if self._slot_refs[s] > 0} | set(self._backlog)

    def queued(self) -> tuple[int, int, int]:
        """(stores, restores, relocations) waiting for a real batch."""
        return len(self._stores), len(self._restores), len(self._relocations)

    def _unref(self, slot: int) -> list[int]:
        self._slot_refs[slot] -= 1
        if self._slot_refs[slot] < 0:
            raise RuntimeError(f"slot {slot}: more ops released than queued")
        if self._slot_refs[slot] == 0:
            del self._slot_refs[slot]
            if slot in self._released_pending:
                self._released_pending.discard(slot)
                return [slot]
        return []


def _slot(slot: object) -> int:
    if not isinstance(slot, int) or isinstance(slot, bool) or slot < 0:
        raise ValueError(f"slot: must be an int >= 0, got {slot!r}")
    return slot

"""Turn a batch's unit table (`maintenance.UnitCopyTable`: whole PAGE units of checkpoint space)
into the byte table of `ops.state_copy_` and run it: ONE launch per batch, on the GPU (Triton)
and the CPU (its torch reference) alike.

The two sides lay bytes out differently. A pool unit is block b's row in every attention layer's
K and V cache, concatenated; a slot image is slot s's row in every state tensor, concatenated
and padded to whole units. Their segment boundaries differ, so one unit maps to a few *pieces*,
each contiguous on both sides. Where the pieces fall inside unit k of an image is the same for
every slot and every block, so it is computed once (`_template`, at start-up) and a batch's table
is that template shifted by each op's slot and block offsets, with tensor arithmetic rather than
per-piece Python.

`ops.state_copy_` counts in units of `unit_bytes`: here the gcd of every segment's row width,
so each piece is a whole number of them (rows of `(src pool, src offset, unit_bytes, dst pool,
dst offset, unit_bytes, piece bytes / unit_bytes)`). The pools are the byte views of the K/V
caches (pool index = segment index) followed by those of the state tensors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from atom_runtime.state.checkpoint_spec import PagedStateCheckpointSpec


class StateCopyPlan:
    """The per-model part of the translation: segments, pools and the unit template."""

    def __init__(
        self,
        pool_segments: Sequence[torch.Tensor],
        slot_segments: Sequence[torch.Tensor],
        spec: PagedStateCheckpointSpec,
    ) -> None:
        """pool_segments / slot_segments: `uint8_rows` views ([blocks, bytes], [slots, bytes]) in
        unit order, as `copy_units_reference` takes them."""
        self.spec = spec
        self.pool_widths = [int(s.shape[1]) for s in pool_segments]
        self.slot_widths = [int(s.shape[1]) for s in slot_segments]
        if sum(self.pool_widths) != spec.page_unit_bytes:
            raise ValueError(
                f"pool segments hold {sum(self.pool_widths)} bytes a block, the spec says "
                f"{spec.page_unit_bytes}"
            )
        if sum(self.slot_widths) != spec.image_bytes:
            raise ValueError(
                f"slot segments hold {sum(self.slot_widths)} bytes a slot, the spec says "
                f"{spec.image_bytes}"
            )
        self.num_pool_units = int(pool_segments[0].shape[0])
        self.num_slots = int(slot_segments[0].shape[0])
        self.pools = [s.reshape(-1) for s in (*pool_segments, *slot_segments)]
        self.unit_bytes = math.gcd(*self.pool_widths, *self.slot_widths)
        self._num_pool_segments = len(self.pool_widths)
        self._template = self._build_template()

    def _build_template(self) -> torch.Tensor:
        """int64 [P, 6]: (image unit k, pool segment, offset in the block's row, slot segment,
        offset in the slot's row, bytes) for every piece of every unit of an image."""
        p = self.spec.page_unit_bytes
        pool_starts = [0]
        for w in self.pool_widths:
            pool_starts.append(pool_starts[-1] + w)
        slot_starts = [0]
        for w in self.slot_widths:
            slot_starts.append(slot_starts[-1] + w)
        pieces = []
        m = 0
        for k in range(self.spec.units_per_image):
            for j, w in enumerate(self.pool_widths):
                lo = k * p + pool_starts[j]  # image bytes this pool segment of unit k holds
                hi = min(lo + w, self.spec.image_bytes)
                while lo < hi:
                    while slot_starts[m + 1] <= lo:
                        m += 1
                    end = min(hi, slot_starts[m + 1])
                    pieces.append(
                        (k, j, lo - k * p - pool_starts[j], m, lo - slot_starts[m], end - lo)
                    )
                    lo = end
        return torch.tensor(pieces, dtype=torch.int64)

    def byte_table(self, unit_rows: torch.Tensor) -> torch.Tensor:
        """The `ops.state_copy_` table (int64 [R, 7], host) of a unit table's rows
        (int64 [N, 3]: src unit, dst unit, n units; see `UnitCopyTable`)."""
        base = self.num_pool_units
        per_image = self.spec.units_per_image
        u = self.unit_bytes
        pool_w = torch.tensor(self.pool_widths, dtype=torch.int64)
        slot_w = torch.tensor(self.slot_widths, dtype=torch.int64)
        parts = []
        for src, dst, n in unit_rows.tolist():
            if n <= 0:
                continue
            if src >= base and dst >= base:  # a relocation: slot image to slot image
                (s_slot, s_k), (d_slot, d_k) = (
                    divmod(src - base, per_image),
                    divmod(dst - base, per_image),
                )
                if s_k or d_k or n != per_image:
                    raise ValueError("a slot-to-slot row must copy whole images")
                m = torch.arange(len(self.slot_widths), dtype=torch.int64)
                pool = m + self._num_pool_segments
                parts.append(
                    torch.stack(
                        [
                            pool,
                            s_slot * slot_w,
                            torch.full_like(m, u),
                            pool,
                            d_slot * slot_w,
                            torch.full_like(m, u),
                            slot_w // u,
                        ],
                        1,
                    )  # fmt: skip
                )
                continue
            if src < base and dst < base:
                raise ValueError("a pool-to-pool row has no meaning for state checkpoints")
            image_unit, block = (src, dst) if src >= base else (dst, src)
            slot, k0 = divmod(image_unit - base, per_image)
            t = self._template
            t = t[(t[:, 0] >= k0) & (t[:, 0] < k0 + n)]
            blocks = block + (t[:, 0] - k0)
            pool_side = (t[:, 1], blocks * pool_w[t[:, 1]] + t[:, 2])
            slot_side = (t[:, 3] + self._num_pool_segments, slot * slot_w[t[:, 3]] + t[:, 4])
            s_side, d_side = (slot_side, pool_side) if src >= base else (pool_side, slot_side)
            stride = torch.full_like(t[:, 0], u)
            parts.append(
                torch.stack(
                    [s_side[0], s_side[1], stride, d_side[0], d_side[1], stride, t[:, 5] // u], 1
                )  # fmt: skip
            )
        if not parts:
            return torch.zeros((0, 7), dtype=torch.int64)
        return torch.cat(parts)

    def run(self, unit_rows: torch.Tensor) -> int:
        """Execute a unit table with one `ops.state_copy_` launch; returns the units (of
        `unit_bytes`) copied. The caller orders it before the forward pass that reads the
        slots (same stream)."""
        from atom_kernels import ops

        table = self.byte_table(unit_rows)
        if table.shape[0] == 0:
            return 0
        units = int(table[:, 6].sum())
        device = self.pools[0].device
        ops.state_copy_(self.pools, table.to(device), self.unit_bytes, units)
        return units

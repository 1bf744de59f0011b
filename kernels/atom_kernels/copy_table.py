"""The descriptor table of `ops.state_copy_`: byte ranges to copy within and between uint8
views of memory pools, as an affine unit table (pure torch on the host, no kernels).

A row is a run of equal-sized units: `(src_pool, src_offset, src_stride, dst_pool,
dst_offset, dst_stride, num_units)`, all in bytes; unit i of the run copies `unit_bytes` bytes
from `pools[src_pool][src_offset + i * src_stride:]` to `pools[dst_pool][dst_offset + i *
dst_stride:]`. A checkpoint store (a slot's state cut into pages) or a restore is one row; a
batch's stores, restores and relocations are the rows of one table, one launch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

COLUMNS = (
    "src_pool", "src_offset", "src_stride", "dst_pool", "dst_offset", "dst_stride", "num_units",
)  # fmt: skip


def unit_alignment(unit_bytes: int) -> int:
    """The element width the copy moves: the largest of 8, 4, 2, 1 dividing `unit_bytes`;
    every offset and stride of a table must be a multiple of it."""
    for width in (8, 4, 2, 1):
        if unit_bytes % width == 0:
            return width
    raise AssertionError("unreachable")


def check_table(table: torch.Tensor, pool_bytes: Sequence[int], unit_bytes: int) -> None:
    """Raise ValueError unless every unit of `table` (int64 `[R, 7]`, on the host) lies inside
    its pools, is aligned, and no destination byte is written twice or also read by the same
    launch (the units run in parallel, so such a table has no defined result)."""
    if table.dtype != torch.int64 or table.dim() != 2 or table.shape[1] != len(COLUMNS):
        raise ValueError(
            f"table must be int64 [R, {len(COLUMNS)}], got {table.dtype} {tuple(table.shape)}"
        )
    if unit_bytes <= 0:
        raise ValueError(f"unit_bytes must be positive, got {unit_bytes}")
    align = unit_alignment(unit_bytes)
    sizes = torch.tensor(list(pool_bytes), dtype=torch.int64)
    spool, soff, sstride, dpool, doff, dstride, count = table.t()
    if (count < 0).any():
        raise ValueError("table: num_units must be >= 0")
    for name, pool in (("src_pool", spool), ("dst_pool", dpool)):
        if ((pool < 0) | (pool >= len(sizes))).any():
            raise ValueError(f"table: {name} must index one of the {len(sizes)} pools")
    if ((table[:, [1, 2, 4, 5]] % align) != 0).any():
        raise ValueError(f"table: offsets and strides must be multiples of {align} bytes")
    live = count > 0
    last = (count - 1).clamp(min=0)
    for name, pool, off, stride in (("src", spool, soff, sstride), ("dst", dpool, doff, dstride)):
        lo = torch.minimum(off, off + last * stride)
        hi = torch.maximum(off, off + last * stride) + unit_bytes
        if (live & ((lo < 0) | (hi > sizes[pool.clamp(0, len(sizes) - 1)]))).any():
            raise ValueError(f"table: a {name} unit lies outside its pool")
    # Overlaps, unit by unit (tables hold a batch's worth of units: thousands at most).
    runs = torch.repeat_interleave(torch.arange(table.shape[0]), count)
    within = torch.arange(runs.shape[0]) - (count.cumsum(0) - count)[runs]
    src = torch.stack([spool[runs], soff[runs] + within * sstride[runs]], 1)
    dst = torch.stack([dpool[runs], doff[runs] + within * dstride[runs]], 1)
    _check_disjoint(dst, dst, unit_bytes, "two destination units overlap", same=True)
    _check_disjoint(dst, src, unit_bytes, "a destination unit overlaps a source unit", same=False)


def _check_disjoint(a, b, unit_bytes, message, *, same):
    """No interval [start, start + unit_bytes) of `a` meets one of `b` in the same pool (for
    `same`, a unit is not compared with itself)."""
    if a.shape[0] == 0 or b.shape[0] == 0:
        return
    keys_b = b[:, 0] * (1 << 48) + b[:, 1]
    order = torch.argsort(keys_b)
    sorted_b = keys_b[order]
    keys_a = a[:, 0] * (1 << 48) + a[:, 1]
    # The b unit starting at or before a's start, and the one just after it.
    pos = torch.searchsorted(sorted_b, keys_a, right=True)
    for shift in (-1, 0):
        j = pos + shift
        ok = (j >= 0) & (j < sorted_b.shape[0])
        jj = j.clamp(0, sorted_b.shape[0] - 1)
        other = sorted_b[jj]
        hit = ok & ((other - keys_a).abs() < unit_bytes)
        if same:
            hit &= order[jj] != torch.arange(a.shape[0])
        if hit.any():
            raise ValueError(f"table: {message}")


def state_copy_table(
    runs: Sequence[Sequence[int]], pool_bytes: Sequence[int], unit_bytes: int
) -> torch.Tensor:
    """Build and check a table (int64 `[R, 7]`, on the host) from rows `(src_pool, src_offset,
    src_stride, dst_pool, dst_offset, dst_stride, num_units)` in bytes."""
    table = torch.tensor([list(r) for r in runs], dtype=torch.int64).reshape(-1, len(COLUMNS))
    check_table(table, pool_bytes, unit_bytes)
    return table

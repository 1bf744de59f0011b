"""Triton descriptor-driven byte copy: every unit of an affine unit table (see
`atom_kernels.copy_table`) in one launch, one program per unit, across any number of pools.

The pools are addressed from the first pool's pointer plus each pool's distance from it (GPU
memory is one flat address space), so a single launch serves stores, restores and relocations
between a state-slot pool and the KV pool alike. The copy moves 8-, 4-, 2- or 1-byte words,
the widest that divides the unit size (offsets and strides are multiples of it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from atom_kernels.copy_table import unit_alignment

_WORD = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
# Each pool's distance from the first, per (device, pool addresses): a device tensor built
# once, so a launch inside a CUDA graph does not copy from the host.
_pool_offsets: dict[tuple, torch.Tensor] = {}


@triton.jit
def _state_copy_kernel(
    base_ptr, pool_offsets_ptr, table_ptr, run_end_ptr, run_of_unit_ptr, num_runs,
    WORD: tl.constexpr, UNIT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    u = tl.program_id(0)
    run = tl.load(run_of_unit_ptr + u)
    if run >= num_runs:
        return  # a program past the table's units (launch sized by an upper bound)
    row = table_ptr + run * 7
    count = tl.load(row + 6)
    i = u - (tl.load(run_end_ptr + run) - count)  # the unit's index inside its run
    src = (
        tl.load(pool_offsets_ptr + tl.load(row + 0))
        + (tl.load(row + 1) + i * tl.load(row + 2)) // WORD
    )
    dst = (
        tl.load(pool_offsets_ptr + tl.load(row + 3))
        + (tl.load(row + 4) + i * tl.load(row + 5)) // WORD
    )
    offs = tl.arange(0, BLOCK)
    for start in range(0, UNIT, BLOCK):
        m = (start + offs) < UNIT
        words = tl.load(base_ptr + src + start + offs, mask=m)
        tl.store(base_ptr + dst + start + offs, words, mask=m)


def _offsets(pools: Sequence[torch.Tensor], word: int) -> torch.Tensor:
    key = (pools[0].device, word) + tuple(p.data_ptr() for p in pools)
    cached = _pool_offsets.get(key)
    if cached is None:
        base = pools[0].data_ptr()
        distances = [(p.data_ptr() - base) for p in pools]
        if any(d % word for d in distances):
            raise ValueError(f"pools must start {word}-byte aligned relative to each other")
        cached = torch.tensor(
            [d // word for d in distances], dtype=torch.int64, device=pools[0].device
        )
        _pool_offsets[key] = cached
    return cached


def state_copy_(pools, table, unit_bytes, max_units):
    """See `atom_kernels.ops.state_copy_`. No host sync when `table` is on the device."""
    word = unit_alignment(unit_bytes)
    if max_units == 0 or table.shape[0] == 0:
        return
    table = table.to(pools[0].device)
    first = pools[0]
    try:  # the first pool as words: the base pointer every address is counted from
        base = first[: first.numel() // word * word].view(_WORD[word])
    except RuntimeError as e:
        raise ValueError(
            f"pools[0] must start {word}-byte aligned for unit_bytes={unit_bytes}"
        ) from e
    run_end = table[:, 6].cumsum(0)
    units = torch.arange(max_units, device=table.device)
    run_of_unit = torch.searchsorted(run_end, units, right=True)
    unit = unit_bytes // word
    _state_copy_kernel[(max_units,)](
        base, _offsets(pools, word), table, run_end, run_of_unit, table.shape[0],
        WORD=word, UNIT=unit, BLOCK=min(triton.next_power_of_2(unit), 2048), num_warps=4,
    )  # fmt: skip

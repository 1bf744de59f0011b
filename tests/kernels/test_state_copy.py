"""`ops.state_copy_`: the affine unit table's checks, the torch reference against plain byte
slicing, and the Triton kernel (interpreted on CPU, compiled on a GPU) against the reference."""

from __future__ import annotations

import pytest
import torch

from atom_kernels import ops, reference
from atom_kernels.copy_table import state_copy_table


def _pools(sizes, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).to(device) for n in sizes]


def _slice_copy(pools, runs, unit_bytes):
    """The specification: each unit as a Python slice assignment, in order."""
    out = [p.clone() for p in pools]
    for sp, so, ss, dp, do, ds, n in runs:
        for i in range(n):
            src = out[sp][so + i * ss : so + i * ss + unit_bytes].clone()
            out[dp][do + i * ds : do + i * ds + unit_bytes] = src
    return out


# Three pools: "KV pages" (0), "state slots" (1), a scratch pool (2). Stores (slot -> pages,
# pages not adjacent: stride 2 units), a restore (pages -> slot), a relocation inside pool 0,
# and a backwards run (negative stride).
SIZES = [1200, 600, 250]


def _runs(unit):
    return [
        (1, 0, unit, 0, 0, 2 * unit, 4),  # slot 0 of pool 1 -> every other page of pool 0
        (0, 9 * unit, unit, 1, 5 * unit, unit, 3),  # pages 9..11 -> slot 1
        (0, 20 * unit, unit, 0, 30 * unit, unit, 2),  # relocation within pool 0
        (1, 12 * unit, -unit, 2, 0, unit, 2),  # backwards read into the scratch pool
        (2, 5 * unit, unit, 2, 7 * unit, unit, 0),  # an empty run
    ]


@pytest.mark.parametrize("unit", [24, 6, 5])  # 8-, 2- and 1-byte words
def test_reference_equals_byte_slices(unit):
    pools = _pools(SIZES, "cpu", seed=1)
    runs = _runs(unit)
    want = _slice_copy(pools, runs, unit)
    table = state_copy_table(runs, SIZES, unit)
    ops.state_copy_(pools, table, unit, int(table[:, 6].sum()))
    for got, exp in zip(pools, want, strict=True):
        assert torch.equal(got, exp)


@pytest.mark.parametrize("unit", [24, 6, 5])
def test_kernel_matches_reference(kernels, device, unit):
    pools = _pools(SIZES, device, seed=2)
    want = [p.clone() for p in pools]
    table = state_copy_table(_runs(unit), SIZES, unit).to(device)
    total = int(table[:, 6].sum())
    reference.state_copy_(want, table, unit, total)
    kernels["state_copy"].state_copy_(pools, table, unit, total + 5)  # 5 idle programs
    for got, exp in zip(pools, want, strict=True):
        assert torch.equal(got, exp)


def test_kernel_and_reference_stop_at_max_units(kernels, device):
    unit = 8
    pools = _pools(SIZES, device, seed=3)
    want = [p.clone() for p in pools]
    table = state_copy_table(_runs(unit), SIZES, unit).to(device)
    reference.state_copy_(want, table, unit, 5)  # the first run's 4 units + 1 of the second
    before = [p.clone() for p in pools]
    kernels["state_copy"].state_copy_(pools, table, unit, 5)
    for got, exp in zip(pools, want, strict=True):
        assert torch.equal(got, exp)
    assert not torch.equal(pools[1][5 * unit : 6 * unit], before[1][5 * unit : 6 * unit])
    assert torch.equal(pools[1][6 * unit : 8 * unit], before[1][6 * unit : 8 * unit])


@pytest.mark.parametrize(
    ("runs", "match"),
    [
        ([(0, 0, 8, 1, 600, 8, 1)], "outside its pool"),
        ([(0, -8, 8, 1, 0, 8, 1)], "outside its pool"),
        ([(0, 0, 8, 3, 0, 8, 1)], "dst_pool"),
        ([(0, 4, 8, 1, 0, 8, 1)], "multiples of 8"),
        ([(0, 0, 8, 1, 0, 4 * 2, 2), (0, 64, 8, 1, 8, 8, 1)], "two destination units overlap"),
        ([(0, 0, 8, 0, 8, 8, 2)], "destination unit overlaps a source"),
        ([(0, 0, 8, 1, 0, 8, -1)], "num_units"),
    ],
)
def test_table_checks_name_the_problem(runs, match):
    with pytest.raises(ValueError, match=match):
        state_copy_table(runs, SIZES, 8)


def test_op_checks_pools_and_table():
    pools = _pools(SIZES, "cpu")
    table = state_copy_table(_runs(8), SIZES, 8)
    with pytest.raises(ValueError, match=r"pools\[1\]"):
        ops.state_copy_([pools[0], pools[1].view(torch.int8)], table, 8, 9)
    with pytest.raises(ValueError, match="table must be int64"):
        ops.state_copy_(pools, table.int(), 8, 9)
    with pytest.raises(ValueError, match="pools must hold"):
        ops.state_copy_([], table, 8, 9)

"""Tensor-parallel state for this process: rank, world size and the few collectives we need.

With one rank (the default) every collective is the identity, so single-device code pays nothing.
Ranks are wired by torch.distributed (NCCL on NVIDIA, RCCL on AMD, gloo on CPU).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from atom_runtime import envs

# A collective that waits longer than this raises instead of hanging (a stuck peer). A peer that
# died is noticed much sooner: gloo sees the closed connection, and the executor's liveness watch
# aborts NCCL collectives.
TIMEOUT_ENV = envs.TP_TIMEOUT_S.name
DEFAULT_TIMEOUT_S = 300.0

_rank = 0
_world_size = 1


def collective_timeout_s() -> float:
    value = os.environ.get(TIMEOUT_ENV, "")
    timeout = float(value) if value else DEFAULT_TIMEOUT_S
    if timeout <= 0:
        raise ValueError(f"{TIMEOUT_ENV}: must be > 0 seconds, got {value!r}")
    return timeout


def init_tensor_parallel(rank: int, world_size: int, init_method: str, backend: str) -> None:
    global _rank, _world_size
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: must be in [0, {world_size}), got {rank}")
    if world_size > 1:
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=collective_timeout_s()),
        )
    _rank, _world_size = rank, world_size


def destroy_tensor_parallel() -> None:
    global _rank, _world_size
    if _world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _rank, _world_size = 0, 1


def abort_tensor_parallel() -> None:
    """Make collectives in flight on this rank fail now (a peer died): NCCL would otherwise spin
    until its timeout. Gloo already fails on the peer's closed connection."""
    if _world_size > 1 and dist.is_initialized() and dist.get_backend() == "nccl":
        dist.distributed_c10d._abort_process_group()


def tp_rank() -> int:
    return _rank


def tp_size() -> int:
    return _world_size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _world_size > 1:
        dist.all_reduce(x)
    return x


def all_reduce_min(value: int, device: torch.device) -> int:
    """The smallest of every rank's `value` (e.g. KV blocks that fit on every rank)."""
    if _world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    if _world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_world_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def gather_rows(x: torch.Tensor) -> torch.Tensor | None:
    """Every rank's `x` stacked along dim 0 on rank 0 (rank order); None on the other ranks.
    Every rank must call it (a collective)."""
    if _world_size == 1:
        return x
    x = x.contiguous()
    if _rank != 0:
        dist.gather(x, None, dst=0)
        return None
    parts = [torch.empty_like(x) for _ in range(_world_size)]
    dist.gather(x, parts, dst=0)
    return torch.cat(parts, dim=0)


@contextmanager
def rank_local() -> Iterator[None]:
    """Run as a group of one inside the block: layers built here are whole (unsharded) and
    their collectives are the identity. Rank 0's drafting model (speculative decoding) is
    built and run this way beside its sharded target; the process group stays as it was."""
    global _rank, _world_size
    saved = _rank, _world_size
    _rank, _world_size = 0, 1
    try:
        yield
    finally:
        _rank, _world_size = saved

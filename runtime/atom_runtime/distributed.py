"""Tensor-parallel state for this process: rank, world size and the one collective we need.

With one rank (the default) every collective is the identity, so single-device code pays nothing.
Ranks are wired by torch.distributed (NCCL on NVIDIA, RCCL on AMD, gloo on CPU).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_rank = 0
_world_size = 1


def init_tensor_parallel(rank: int, world_size: int, init_method: str, backend: str) -> None:
    global _rank, _world_size
    if world_size > 1:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    _rank, _world_size = rank, world_size


def destroy_tensor_parallel() -> None:
    global _rank, _world_size
    if _world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _rank, _world_size = 0, 1


def tp_rank() -> int:
    return _rank


def tp_size() -> int:
    return _world_size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _world_size > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    if _world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_world_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)

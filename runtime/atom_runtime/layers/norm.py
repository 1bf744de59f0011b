from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from atom_kernels import ops
from atom_runtime.layers.weights import copy_weight


class SummedRow(NamedTuple):
    """What a layer passes on in place of the residual when the projection that wrote the row
    already added the residual to it (`LinearBase.forward_adding`): the row is hidden +
    residual, `sq` holds that GEMV's sums of squares of it (their sum is the row's) and
    `scaled` the row times `norm_weight`, the weight of the RMSNorm it goes to next, from which
    the GEMV after that norm takes its normed input (`LinearBase.forward_normed`). Any other
    consumer norms the row as it is: the add is done."""

    sq: torch.Tensor
    scaled: torch.Tensor
    norm_weight: torch.Tensor

    def scaled_for(self, norm: RMSNorm) -> torch.Tensor | None:
        """`scaled` when it was made with `norm`'s weight, else None."""
        return self.scaled if self.norm_weight is norm.weight else None


class RMSNorm(nn.Module):
    """RMSNorm; given a residual, adds it first and returns (normed, new residual). Given a
    `SummedRow`, the row already holds the sum: returns (normed, the row)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        copy_weight(param.data, loaded)  # replicated: every rank holds the whole vector

    def forward(self, x: torch.Tensor, residual: torch.Tensor | SummedRow | None = None):
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        if isinstance(residual, SummedRow):
            return ops.rms_norm(x, self.weight, self.eps), x
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)

    def with_residual(self, x: torch.Tensor, residual: torch.Tensor | None):
        """(normed, residual after the add) either way: x itself is the residual without one."""
        return (self(x), x) if residual is None else self(x, residual)

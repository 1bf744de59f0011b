from __future__ import annotations

import torch
from torch import nn

from atom_kernels import ops
from atom_runtime.layers.weights import copy_weight


class RMSNorm(nn.Module):
    """RMSNorm; given a residual, adds it first and returns (normed, new residual)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        copy_weight(param.data, loaded)  # replicated: every rank holds the whole vector

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)

    def with_residual(self, x: torch.Tensor, residual: torch.Tensor | None):
        """(normed, residual after the add) either way: x itself is the residual without one."""
        return (self(x), x) if residual is None else self(x, residual)

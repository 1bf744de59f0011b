"""Vocab-parallel token embedding and LM head: each rank holds a contiguous slice of the vocab."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atom_runtime.layers.weights import copy_weight
from atom_runtime.system.distributed import all_gather_last_dim, all_reduce, tp_rank, tp_size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // tp_size())
        self.start = tp_rank() * self.per_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """Rows [start, start + per_rank) of the checkpoint's vocab; the last rank's padding rows
        (when the vocab does not divide evenly) stay zero."""
        if tuple(loaded.shape) != (self.vocab_size, param.data.shape[1]):
            raise ValueError(
                f"checkpoint tensor {tuple(loaded.shape)} does not fit a vocab of "
                f"{self.vocab_size} x {param.data.shape[1]}"
            )
        rows = max(0, min(self.per_rank, self.vocab_size - self.start))
        param.data.zero_()
        if rows:
            copy_weight(param.data[:rows], loaded.narrow(0, self.start, rows))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        mask = (local < 0) | (local >= self.per_rank)
        y = F.embedding(local.masked_fill(mask, 0), self.weight)
        y.masked_fill_(mask.unsqueeze(-1), 0)
        return all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits from the final hidden states; each rank computes its vocab slice, then gathers."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        if tp_size() > 1:
            logits = all_gather_last_dim(logits)
        return logits[..., : self.vocab_size]

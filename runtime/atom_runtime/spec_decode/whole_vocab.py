"""The target's whole-vocabulary embedding and LM head on rank 0, for an MTP head under tensor
parallelism.

An MTP head shares the target's embedding and LM head (models/mtp.py), but under tensor
parallelism each rank holds only its slice of the vocabulary, and the head runs on rank 0
alone, outside the group (`rank_local`). So once, at start-up, every rank sends its slices to
rank 0 (`gather_rows`, a collective), which keeps one unsharded copy: 2 x vocab x hidden
parameters of extra memory on rank 0 (1 x with tied embeddings), the price of drafting there
without a collective per draft token.
"""

from __future__ import annotations

import torch
from torch import nn

from atom_runtime.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from atom_runtime.system.distributed import gather_rows, rank_local


class WholeVocab(nn.Module):
    """What an MTP head reads of its target: `model.embed_tokens` and `compute_logits` unsharded;
    anything else (DeepSeek's head reads the rotary table and the stacked-parameter names, which
    no rank shards) from the target itself."""

    def __init__(
        self, embed: VocabParallelEmbedding, lm_head: ParallelLMHead, target: nn.Module
    ) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = embed
        self.lm_head = lm_head
        object.__setattr__(self, "_target", target)  # not a submodule: its weights stay its own

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_target"), name)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


def gather_whole_vocab(target: nn.Module) -> WholeVocab | None:
    """Rank 0: the whole-vocabulary copy of `target`'s embedding and LM head; other ranks: None.
    Every rank of the group must call it."""
    embed, head = target.model.embed_tokens, target.lm_head
    tied = head.weight is embed.weight
    embed_rows = gather_rows(embed.weight.data)
    head_rows = embed_rows if tied else gather_rows(head.weight.data)
    if embed_rows is None:
        return None
    with rank_local(), torch.device(embed.weight.device):
        whole_embed = _whole(VocabParallelEmbedding, embed, embed_rows)
        whole_head = _whole(ParallelLMHead, head, head_rows)
    if tied:
        whole_head.weight = whole_embed.weight
    return WholeVocab(whole_embed, whole_head, target)


def _whole(kind, sharded: VocabParallelEmbedding, rows: torch.Tensor):
    """An unsharded `kind` holding the gathered rows (the last rank's padding rows dropped)."""
    layer = kind(sharded.vocab_size, rows.shape[1])
    layer.weight.data = rows[: sharded.vocab_size].clone()
    return layer

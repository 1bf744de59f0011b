"""N-gram drafts (prompt lookup, vLLM's `ngram` method): no weights, host only.

The drafts for a sequence are the tokens that followed an earlier occurrence of its longest
suffix n-gram, n in [prompt_lookup_min, prompt_lookup_max] (the latest with k tokens after it):
text that repeats or edits its prompt (code, documents, quotes) continues as it went before. Nothing found: no drafts,
and the sequence decodes one token that step.
"""

from __future__ import annotations

import numpy as np

from atom_runtime.core.sequence import Sequence


def ngram_drafts(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens following an earlier occurrence of the longest suffix n-gram of `tokens`
    (n from max_n down to min_n): the latest one followed by k tokens, else the earliest; []
    when none occurs earlier."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        # Starts i of an earlier occurrence: i + n <= length - 1 (not the suffix itself).
        candidates = np.flatnonzero(tokens[: length - n] == suffix[0])
        for j in range(1, n):
            if not len(candidates):
                break
            candidates = candidates[tokens[candidates + j] == suffix[j]]
        if len(candidates):
            # The latest occurrence with k tokens after it; failing that (a loop closing on the
            # suffix itself), the earliest, whose continuation runs furthest.
            full = candidates[candidates + n + k <= length]
            start = int(full[-1] if len(full) else candidates[0]) + n
            return tokens[start : start + k].tolist()
    return []


class NgramDrafter:
    """Drafts from each sequence's own tokens (prompt and output)."""

    needs_hidden_states = False
    needs_step_chunks = False

    def __init__(self, k: int, min_n: int, max_n: int) -> None:
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def propose(self, seqs: list[Sequence], chunks=None, hidden=None) -> list[list[int]]:
        """Drafts for every sequence ready to decode (its last token not yet run); [] for a
        sequence still in its prompt."""
        out = []
        for seq in seqs:
            if seq.num_computed_tokens != seq.num_tokens - 1:
                out.append([])
                continue
            tokens = np.frombuffer(seq.token_ids, dtype=np.int32)
            out.append(ngram_drafts(tokens, self.k, self.min_n, self.max_n))
        return out

    def attention_layers(self) -> list:
        return []

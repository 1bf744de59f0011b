"""N-gram drafts: the continuation of the longest earlier suffix match, its latest occurrence
with k tokens after it, the earliest when a loop leaves none; nothing when nothing matches."""

from __future__ import annotations

import numpy as np

from atom_runtime.spec_decode.ngram import ngram_drafts


def _drafts(tokens, k=3, low=1, high=3):
    return ngram_drafts(np.asarray(tokens, dtype=np.int32), k, low, high)


def test_the_longest_suffix_match_wins():
    # "7 8" occurs after 1 and after 4; the suffix "4 7 8" matches only the second.
    assert _drafts([1, 7, 8, 9, 9, 4, 7, 8, 5, 6, 4, 7, 8]) == [5, 6, 4]


def test_the_latest_occurrence_with_k_tokens_after_it():
    assert _drafts([5, 1, 2, 3, 5, 4, 4, 4, 5], k=2, high=1) == [4, 4]
    # The latest earlier "5" has two tokens after it, not three: the one before that wins.
    assert _drafts([5, 1, 2, 7, 5, 6, 5], k=3, high=1) == [1, 2, 7]


def test_a_loop_closing_on_itself_takes_the_earliest_occurrence():
    assert _drafts([9, 9, 9, 9, 9], k=3, low=2, high=3) == [9, 9]


def test_no_match_below_the_minimum_gives_no_drafts():
    assert _drafts([1, 2, 3, 4, 5]) == []
    assert _drafts([1, 2, 3, 1, 9, 2, 3], low=3, high=3) == []  # "2 3" only: below 3
    assert _drafts([4]) == []


def _reference(tokens, k, low, high):
    """The definition, checked start by start."""
    length = len(tokens)
    for n in range(min(high, length - 1), low - 1, -1):
        suffix = tokens[length - n :]
        starts = [i for i in range(length - n) if tokens[i : i + n] == suffix]
        if starts:
            full = [i for i in starts if i + n + k <= length]
            start = (full[-1] if full else starts[0]) + n
            return tokens[start : start + k]
    return []


def test_matches_the_definition_on_random_token_runs():
    rng = np.random.default_rng(0)
    for _ in range(500):
        tokens = rng.integers(0, 3, int(rng.integers(1, 40))).tolist()
        k, low = int(rng.integers(1, 6)), int(rng.integers(1, 4))
        high = low + int(rng.integers(0, 4))
        assert _drafts(tokens, k, low, high) == _reference(tokens, k, low, high), (
            tokens,
            k,
            low,
            high,
        )

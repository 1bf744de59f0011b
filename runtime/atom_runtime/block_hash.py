"""Chained prefix hashes of KV blocks (contract 1, docs/architecture.md).

A block's hash is xxh64 over [the parent block's digest as 8 bytes little-endian, when there is a
parent] followed by the block's token ids as int64 little-endian; the digest is an unsigned 64-bit
int. The bytes are the same whether the tokens arrive as a list or an `array("i")`, so the hash is
too: routers re-derive these keys from the token ids published in KV events.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np
import xxhash


def hash_block_tokens(parent: int | None, tokens: Sequence[int] | array) -> int:
    """The chained hash of one block of tokens, given its parent block's hash (None for the first)."""
    h = xxhash.xxh64()
    if parent is not None:
        h.update(parent.to_bytes(8, "little", signed=False))
    h.update(np.asarray(tokens, dtype="<i8").tobytes())
    return h.intdigest()


def hash_token_blocks(
    tokens: Sequence[int] | array, block_size: int, parent: int | None = None
) -> list[int]:
    """Hashes of every full block of `tokens`, chained from `parent`."""
    hashes = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, tokens[start : start + block_size])
        hashes.append(parent)
    return hashes

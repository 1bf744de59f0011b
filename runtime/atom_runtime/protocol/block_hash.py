"""Chained prefix hashes of KV blocks (contract 1, docs/architecture.md).

A block's hash is xxh64 over [the parent block's digest as 8 bytes little-endian, when there is a
parent] followed by the block's token ids as int64 little-endian; the digest is an unsigned 64-bit
int. The bytes are the same whether the tokens arrive as a list or an `array("i")`, so the hash is
too: routers re-derive these keys from the token ids published in KV events.

A request's `cache_salt` (vLLM's field) makes its chain start from `salt_root(salt)` instead of
from nothing: the first block is hashed with that root as its parent, so a salted prompt and an
unsalted one (or one of another salt) never share a block, and the unsalted hash stays exactly
the one above. The root is not a block: KV events name no parent for a salted first block.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np
import xxhash

_SALT_LABEL = b"atom-cache-salt\x00"


def salt_root(cache_salt: str | None) -> int | None:
    """The parent the first block of a prompt with this cache_salt is hashed under (None:
    unsalted)."""
    if cache_salt is None:
        return None
    return xxhash.xxh64_intdigest(_SALT_LABEL + cache_salt.encode("utf-8"))


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
    """Hashes of every full block of `tokens`, chained from `parent`.

    The same digests as `hash_block_tokens` block by block, but the tokens are converted to int64
    bytes once and each block is one C call on a slice: admitting a request over an 8k-token
    prefix hashes 500 blocks, and doing it block by block in Python cost most of the admission."""
    num_blocks = len(tokens) // block_size
    data = np.asarray(tokens[: num_blocks * block_size], dtype="<i8").tobytes()
    step = block_size * 8
    digest = xxhash.xxh64_intdigest
    hashes = []
    for start in range(0, num_blocks * step, step):
        block = data[start : start + step]
        parent = digest(block if parent is None else parent.to_bytes(8, "little") + block)
        hashes.append(parent)
    return hashes

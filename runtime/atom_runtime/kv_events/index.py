"""Which pod holds which KV block, rebuilt from the pods' KV events (the router's view).

Keys are the engine's chained block hashes (contract 1). `match_prefix` answers "how many leading
full blocks of these tokens does pod X hold" by hashing the tokens the same way the engine does,
so a router needs nothing but the token ids of a prompt.
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Iterator, Sequence

from atom_runtime.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch


def _block_hashes(
    token_ids: Sequence[int] | array, block_size: int, cache_salt: str | None = None
) -> Iterator[int]:
    """Chained hashes of the full blocks of `token_ids` (from `cache_salt`'s root, as the engine
    hashes a salted prompt), computed one block at a time."""
    if type(block_size) is not int or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    # The engine owns the hash function; one definition keeps routers and engine in step.
    from atom_runtime.protocol.block_hash import hash_block_tokens, salt_root

    parent: int | None = salt_root(cache_salt)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size])
        yield parent


class PrefixIndex:
    """Block hash -> pods holding it, and pod -> its hashes; safe to share between threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pods_by_hash: dict[int, set[str]] = {}
        self._hashes_by_pod: dict[str, set[int]] = {}

    def apply(self, pod: str, batch: EventBatch) -> None:
        """Apply one batch of `pod`'s events, in order."""
        with self._lock:
            held = self._hashes_by_pod.setdefault(pod, set())
            for event in batch.events:
                if isinstance(event, BlockStored):
                    for h in event.block_hashes:
                        held.add(h)
                        self._pods_by_hash.setdefault(h, set()).add(pod)
                elif isinstance(event, BlockRemoved):
                    for h in event.block_hashes:
                        held.discard(h)
                        self._forget(h, pod)
                elif isinstance(event, AllBlocksCleared):
                    for h in held:
                        self._forget(h, pod)
                    held.clear()
                else:
                    raise TypeError(f"not a KV event: {type(event).__name__}")

    def _forget(self, block_hash: int, pod: str) -> None:
        pods = self._pods_by_hash.get(block_hash)
        if pods is not None:
            pods.discard(pod)
            if not pods:
                del self._pods_by_hash[block_hash]

    def remove_pod(self, pod: str) -> None:
        """Forget a pod entirely (it went away)."""
        with self._lock:
            for h in self._hashes_by_pod.pop(pod, set()):
                self._forget(h, pod)

    def pods(self) -> list[str]:
        """Every pod the index has heard from, sorted."""
        with self._lock:
            return sorted(self._hashes_by_pod)

    def hashes(self, pod: str) -> set[int]:
        """A copy of the block hashes `pod` holds."""
        with self._lock:
            return set(self._hashes_by_pod.get(pod, ()))

    def holders(self, block_hash: int) -> set[str]:
        """A copy of the pods holding `block_hash`."""
        with self._lock:
            return set(self._pods_by_hash.get(block_hash, ()))

    def match_prefix(
        self,
        pod: str,
        token_ids: Sequence[int] | array,
        block_size: int,
        cache_salt: str | None = None,
    ) -> int:
        """How many leading full blocks of `token_ids` (under `cache_salt`) `pod` holds."""
        matched = 0
        with self._lock:
            held = self._hashes_by_pod.get(pod, set())
            for h in _block_hashes(token_ids, block_size, cache_salt):
                if h not in held:
                    break
                matched += 1
        return matched

    def best_pods(
        self, token_ids: Sequence[int] | array, block_size: int, cache_salt: str | None = None
    ) -> list[tuple[str, int]]:
        """Every known pod with its matched leading blocks (of `token_ids` under `cache_salt`),
        most blocks first (ties by name)."""
        with self._lock:
            matched = dict.fromkeys(self._hashes_by_pod, 0)
            still: set[str] | None = None
            blocks = _block_hashes(token_ids, block_size, cache_salt)
            for depth, h in enumerate(blocks, start=1):
                holders = self._pods_by_hash.get(h, set())
                still = set(holders) if still is None else still & holders
                if not still:
                    break
                for pod in still:
                    matched[pod] = depth
        return sorted(matched.items(), key=lambda item: (-item[1], item[0]))

"""BlockManager: a sequence's view of the block pool.

It finds a sequence's prefix hits, grows its block table as tokens are scheduled, publishes the
hashes of blocks once the forward pass has computed them (prompt and generated text alike, so a
follow-up turn reuses both), and frees the table. It never touches tensors.

With `sliding_window` (a model whose sliding-window layers keep their own blocks, KV group 1:
docs/kv-groups.md) a sequence also holds `window_table`, the window layers' blocks, index for
index beside `block_table`. Once the next query's window has passed a block, that block goes
back to the pool (its entry becomes -1): a long sequence holds about window / block_size window
blocks, not one per block of its context. A prefix hit needs both groups: the full-attention
blocks of the prefix and the window blocks the next query sees, so it is the longest prefix for
which the window group's cache still holds those.
"""

from __future__ import annotations

from array import array

import numpy as np

from atom_runtime.core.block_pool import BlockPool
from atom_runtime.core.sequence import Sequence
from atom_runtime.protocol.block_hash import hash_token_blocks


class BlockManager:
    def __init__(
        self,
        pool: BlockPool,
        enable_prefix_caching: bool = True,
        sliding_window: int | None = None,
    ) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.enable_prefix_caching = enable_prefix_caching
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window: must be >= 1, got {sliding_window}")
        self.sliding_window = sliding_window
        # The last prompt hashed from scratch: a copy of its hashed tokens and their chain. A
        # new prompt that starts with the same tokens (a shared system prompt, W3's prefix)
        # reuses those digests instead of rehashing: a digest is a function of the tokens from
        # the start of the prompt, so equal leading tokens give equal digests (contract 1).
        # Lookups still compare each hit block's tokens (contract 2). Only a prompt of the same
        # cache_salt (the same chain root) shares them.
        self._recent_tokens = np.zeros(0, dtype=np.int32)
        self._recent_hashes: list[int] = []
        self._recent_root: int | None = None

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_prefix_hit(self, seq: Sequence) -> list[int]:
        """Blocks serving the leading run of seq's full blocks already in the cache.

        The block holding the last token is never a hit: its logits must be computed."""
        if not self.enable_prefix_caching or seq.sampling_params.prompt_logprobs is not None:
            return []  # prompt logprobs need every prompt position's logits computed
        max_blocks = (seq.num_tokens - 1) // self.block_size
        if max_blocks == 0:
            return []
        # A sequence waiting at the head of the queue is looked up again every step until it
        # fits: its hashes are computed once and kept on it.
        self.ensure_hashes(seq, max_blocks)
        hit = self.pool.lookup_prefix(seq.block_hashes[:max_blocks], seq.token_ids, self.block_size)
        if self.sliding_window is not None and hit:
            hit = hit[: self._window_hit_length(seq, len(hit))]
        return hit

    def first_window_block(self, num_computed: int) -> int:
        """The first block the next query (at position num_computed) of a window layer reads."""
        return max(0, num_computed - self.sliding_window + 1) // self.block_size

    def _window_hit_length(self, seq: Sequence, num_hit: int) -> int:
        """The longest n <= num_hit such that the window group's cache holds blocks
        [first_window_block(n blocks), n) of seq's prefix: the deepest hit both groups serve."""
        present: dict[int, bool] = {}
        for n in range(num_hit, 0, -1):
            for i in range(n - 1, self.first_window_block(n * self.block_size) - 1, -1):
                if i not in present:
                    present[i] = self._window_block(seq, i) is not None
                if not present[i]:
                    break
            else:
                return n
        return 0

    def _window_block(self, seq: Sequence, i: int) -> int | None:
        bs = self.block_size
        tokens = seq.token_ids[i * bs : (i + 1) * bs]
        return self.pool.lookup(seq.block_hashes[i], tokens, group=1)

    def allocate(self, seq: Sequence, num_new_tokens: int, prefix_hit: list[int] = ()) -> bool:
        """Grow seq's block table to hold its computed tokens plus num_new_tokens, claiming the
        prefix-hit blocks first (a fresh sequence only). All or nothing: False leaves no trace
        (but window blocks the sequence will never read again, which go back either way)."""
        if prefix_hit and seq.block_table:
            raise RuntimeError("prefix hits apply only to a sequence holding no blocks")
        have = len(seq.block_table) + len(prefix_hit)
        computed = len(prefix_hit) * self.block_size if prefix_hit else seq.num_computed_tokens
        total = self.blocks_needed(computed + num_new_tokens)
        need = total - have
        # A hit on a block nobody holds takes it off the free list: count it against the budget.
        idle_hits = self.pool.num_idle(prefix_hit) if prefix_hit else 0
        window_hit: list[int] = []
        window_need = 0
        if self.sliding_window is not None:
            first = self.first_window_block(computed)
            if prefix_hit:
                window_hit = [self._window_block(seq, i) for i in range(first, len(prefix_hit))]
                if None in window_hit:
                    raise RuntimeError("a prefix hit's window blocks left the cache before use")
                idle_hits += self.pool.num_idle(window_hit)
            else:
                self._release_window(seq, first)
            window_need = total - max(first, len(seq.window_table), len(prefix_hit))
        if max(need, 0) + max(window_need, 0) + idle_hits > self.pool.num_free_blocks:
            return False
        if prefix_hit:
            self.pool.claim_all(prefix_hit)
            seq.block_table.extend(prefix_hit)
            seq.num_hashed_blocks = len(prefix_hit)
            seq.num_computed_tokens = len(prefix_hit) * self.block_size
            if self.sliding_window is not None:
                self.pool.claim_all(window_hit)
                seq.window_start = len(prefix_hit) - len(window_hit)
                seq.window_table = array("i", [-1] * seq.window_start)
                seq.window_table.extend(window_hit)
        if need > 0:
            seq.block_table.extend(self.pool.allocate(need))
        if window_need > 0:
            gap = self.first_window_block(computed) - len(seq.window_table)
            if gap > 0:
                seq.window_table.extend([-1] * gap)
                seq.window_start = len(seq.window_table)
            seq.window_table.extend(self.pool.allocate(window_need))
        return True

    def _release_window(self, seq: Sequence, first: int) -> None:
        """Give back seq's window blocks before block `first`: no query of it reads them again.
        Entries before `seq.window_start` went back already, so a step costs what it frees."""
        table = seq.window_table
        end = min(first, len(table))
        if end <= seq.window_start:
            return
        done = [table[i] for i in range(end - 1, seq.window_start - 1, -1) if table[i] >= 0]
        for i in range(seq.window_start, end):
            table[i] = -1
        seq.window_start = end
        self.pool.free(done)

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks, tail first, so the head of a shared prefix is evicted last."""
        self.pool.free(seq.block_table[::-1])
        seq.block_table = array("i")
        seq.num_hashed_blocks = 0
        if seq.window_table:
            table = seq.window_table
            held = [table[i] for i in range(len(table) - 1, seq.window_start - 1, -1)]
            self.pool.free([b for b in held if b >= 0])
            seq.window_table = array("i")
            seq.window_start = 0

    def publish_computed_blocks(self, seq: Sequence) -> None:
        """Hash every full block the forward pass has now computed, in chain order."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        start = seq.num_hashed_blocks
        if num_full <= start:
            return
        # Never hash over an unhashed parent: a gap in the chain stops hashing for this sequence.
        if start > 0 and self.pool.blocks[seq.block_table[start - 1]].hash is None:
            return
        self.ensure_hashes(seq, num_full)
        tokens = [self._block_tokens(seq, i) for i in range(start, num_full)]
        self.pool.publish_hashes(
            seq.block_table[start:num_full],
            seq.block_hashes[start:num_full],
            tokens,
            parent=seq.block_hashes[start - 1] if start > 0 else None,
        )
        if self.sliding_window is not None:  # the window blocks still held (freed ones: lost)
            held = [i for i in range(start, min(num_full, len(seq.window_table)))]
            held = [i for i in held if seq.window_table[i] >= 0]
            self.pool.publish_hashes(
                [seq.window_table[i] for i in held],
                [seq.block_hashes[i] for i in held],
                [tokens[i - start] for i in held],
                parent=None,
                group=1,
            )
        seq.num_hashed_blocks = num_full

    def ensure_hashes(self, seq: Sequence, num_blocks: int) -> None:
        """Extend seq's cached chain of block hashes to num_blocks (each block hashed once)."""
        hashes = seq.block_hashes
        have = len(hashes)
        if have >= num_blocks:
            return
        bs = self.block_size
        fresh = have == 0
        if fresh and self._recent_hashes and self._recent_root == seq.hash_root:
            have = self._shared_blocks(seq, num_blocks)
            hashes.extend(self._recent_hashes[:have])
        if have < num_blocks:
            tokens = seq.token_ids[have * bs : num_blocks * bs]
            hashes.extend(hash_token_blocks(tokens, bs, hashes[-1] if have else seq.hash_root))
        if fresh:
            self._recent_tokens = np.array(seq.token_ids[: num_blocks * bs], dtype=np.int32)
            self._recent_hashes = list(hashes)
            self._recent_root = seq.hash_root

    def _shared_blocks(self, seq: Sequence, num_blocks: int) -> int:
        """How many leading full blocks seq's tokens share with the last prompt hashed."""
        bs = self.block_size
        n = min(num_blocks, len(self._recent_hashes)) * bs
        mine = np.frombuffer(seq.token_ids, dtype=np.int32, count=n)
        differ = np.flatnonzero(mine != self._recent_tokens[:n])
        return (int(differ[0]) if differ.size else n) // bs

    def _block_tokens(self, seq: Sequence, i: int):
        return seq.token_ids[i * self.block_size : (i + 1) * self.block_size]

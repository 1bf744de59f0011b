"""The KV block pool: fixed-size blocks, reference counts, the prefix-hash index, eviction.

Contracts (docs/architecture.md):
- 2: a prefix hit is the leading run of chained-hash matches whose tokens also match.
- 3: eviction is lazy, at allocation: never-hashed free blocks first, then the least-recently-freed
  cached block. A cache hit claims a block and keeps its hash.
- 5: a block's tokens are an `array("i")`; a list is refused at the boundary.

The pool knows nothing of sequences. It also lends raw blocks to owners that are not sequences
(state checkpoints borrow PAGE units from it) and takes them back, all or nothing.

KV groups (docs/kv-groups.md): a model whose sliding-window layers keep their blocks apart from
the full-attention layers' (GPT-OSS) draws both kinds from this one pool. Each group has its own
prefix index (`cached`: full attention, group 0; `cached_window`: the window's, group 1); a
block remembers which one serves it. KV events describe group 0 only: a window block of a prefix
is worth nothing without the full-attention blocks of the same tokens, which group 0 reports.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict, deque

from atom_runtime.kv_events import AllBlocksCleared, BlockRemoved, BlockStored


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "group")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: array | None = None
        self.group = 0  # the KV group whose prefix index holds the hash

    def set_hash(self, block_hash: int, token_ids: array, group: int = 0) -> None:
        if not isinstance(token_ids, array):
            raise TypeError(
                f"Block.token_ids must be an array('i'), got {type(token_ids).__name__}"
            )
        self.hash = block_hash
        self.token_ids = token_ids
        self.group = group

    def clear_hash(self) -> None:
        self.hash = None
        self.token_ids = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_count}, hash={self.hash})"


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_events: bool = False,
        event_token_ids: bool = True,
        medium: str = "GPU",
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Where the blocks live, as KV events name it (vLLM's "GPU" / "CPU").
        self.medium = medium
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks that hold no hash: handed out first.
        self._free_plain: deque[int] = deque(range(num_blocks))
        # Free blocks that still hold a cached hash, least recently freed first.
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        # The prefix indexes: hash -> the block that serves it; full attention (KV group 0)
        # and sliding-window layers kept apart (group 1).
        self.cached: dict[int, int] = {}
        self.cached_window: dict[int, int] = {}
        # Blocks lent to non-sequence owners (state checkpoints): block id -> owner tag.
        self.lent: dict[int, str] = {}
        self.enable_events = enable_events
        # False: BlockStored events carry hashes only (--kv-events-config include_token_ids).
        self.event_token_ids = event_token_ids
        self._events: list = []

    # -- counts --------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_plain) + len(self._free_cached)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    # -- allocation ----------------------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """Take n free blocks (ref count 1), evicting cached ones lazily. All or nothing."""
        if n > self.num_free_blocks:
            raise NoFreeBlocksError(f"asked for {n} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            if self._free_plain:
                block = self.blocks[self._free_plain.popleft()]
            else:
                block_id, _ = self._free_cached.popitem(last=False)
                block = self.blocks[block_id]
                self._evict(block)
            block.ref_count = 1
            out.append(block.block_id)
        return out

    def claim(self, block_id: int) -> None:
        """Take a reference on a cached block (a prefix hit). Its hash stays."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self._free_cached.pop(block_id)
        block.ref_count += 1

    def claim_all(self, block_ids: list[int]) -> None:
        """`claim` each block (a prefix hit's run), in one loop."""
        blocks, free_cached = self.blocks, self._free_cached
        for block_id in block_ids:
            block = blocks[block_id]
            if block.ref_count == 0:
                del free_cached[block_id]
            block.ref_count += 1

    def num_idle(self, block_ids: list[int]) -> int:
        """How many of these blocks nobody holds (claiming them takes them off the free list)."""
        blocks = self.blocks
        return sum(blocks[b].ref_count == 0 for b in block_ids)

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block, in the order given (freed first = evicted first)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of block {block_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is None:
                    self._free_plain.append(block_id)
                else:
                    self._free_cached[block_id] = None

    def lend(self, n: int, owner: str) -> list[int]:
        """Lend n raw blocks to a non-sequence owner, all or nothing; their hashes are dropped."""
        block_ids = self.allocate(n)
        for block_id in block_ids:
            self.lent[block_id] = owner
        return block_ids

    def take_back(self, block_ids: list[int]) -> None:
        """Take lent blocks back, all or nothing: a block not lent raises before any is freed."""
        stray = [b for b in block_ids if b not in self.lent]
        if stray:
            raise RuntimeError(f"blocks {stray} were not lent")
        for block_id in block_ids:
            del self.lent[block_id]
        self.free(block_ids)

    # -- the prefix index ----------------------------------------------------------------------

    def index(self, group: int) -> dict[int, int]:
        return self.cached if group == 0 else self.cached_window

    @property
    def holds_hashes(self) -> bool:
        return bool(self.cached or self.cached_window)

    def lookup(self, block_hash: int, token_ids: array, group: int = 0) -> int | None:
        """The block serving this hash, if its tokens also match (a hash alone is not proof)."""
        block_id = self.index(group).get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.token_ids != token_ids:
            return None
        return block_id

    def lookup_prefix(self, hashes: list[int], tokens: array, block_size: int) -> list[int]:
        """The blocks serving the leading run of `hashes` (block i covers
        tokens[i*block_size:(i+1)*block_size]) whose tokens also match; stops at the first miss.
        One loop in the pool instead of a `lookup` call per block: an 8k-token prefix is 500."""
        cached, blocks = self.cached, self.blocks
        hits: list[int] = []
        start = 0
        for block_hash in hashes:
            block_id = cached.get(block_hash)
            if block_id is None or blocks[block_id].token_ids != tokens[start : start + block_size]:
                break
            hits.append(block_id)
            start += block_size
        return hits

    def publish_hashes(
        self,
        block_ids: list[int],
        hashes: list[int],
        tokens: list[array],
        parent: int | None,
        group: int = 0,
    ) -> None:
        """Record computed blocks in the index of their KV group. One BlockStored per contiguous
        run of blocks that entered group 0's index; a block whose hash another block already
        serves keeps its hash but does not displace the index entry."""
        if group != 0:
            index = self.cached_window
            for block_id, block_hash, block_tokens in zip(block_ids, hashes, tokens, strict=True):
                self.blocks[block_id].set_hash(block_hash, block_tokens, group)
                index.setdefault(block_hash, block_id)
            return
        prev = parent
        run_parent: int | None = None
        run_hashes: list[int] = []
        run_tokens: list[int] = []
        for block_id, block_hash, block_tokens in zip(block_ids, hashes, tokens, strict=True):
            self.blocks[block_id].set_hash(block_hash, block_tokens)
            if block_hash not in self.cached:
                self.cached[block_hash] = block_id
                if not run_hashes:
                    run_parent = prev
                run_hashes.append(block_hash)
                if self.event_token_ids:
                    run_tokens.extend(block_tokens)
            else:
                self._emit_stored(run_hashes, run_parent, run_tokens)
                run_hashes, run_tokens = [], []
            prev = block_hash
        self._emit_stored(run_hashes, run_parent, run_tokens)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False) while any block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block_id in list(self._free_cached):
            self.blocks[block_id].clear_hash()
            self._free_plain.append(block_id)
        self._free_cached.clear()
        self.cached.clear()
        self.cached_window.clear()
        if self.enable_events:
            self._events.append(AllBlocksCleared())
        return True

    def drain_events(self) -> list:
        """The KV events recorded since the last drain (the engine publishes them once per step)."""
        events, self._events = self._events, []
        return events

    def _evict(self, block: Block) -> None:
        if block.hash is None:
            return
        index = self.index(block.group)
        if index.get(block.hash) == block.block_id:
            del index[block.hash]
            if self.enable_events and block.group == 0:
                self._events.append(BlockRemoved(block_hashes=[block.hash], medium=self.medium))
        block.clear_hash()

    def _emit_stored(self, hashes: list[int], parent: int | None, tokens: list[int]) -> None:
        if hashes and self.enable_events:
            self._events.append(
                BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=parent,
                    token_ids=tokens,
                    block_size=self.block_size,
                    medium=self.medium,
                )
            )

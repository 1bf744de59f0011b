"""The one seam between the engine and a KV transport, and the engine's KV cache as bytes.

A transport moves whole KV blocks from a producer engine (it computed a prompt) to a consumer
engine (it will decode that prompt). Block bookkeeping (which blocks are held, when they are
released, what a consumer lacks) lives in `TransferAgent` and is the same for every transport;
a transport only serves reads of held blocks and performs pulls into blocks the agent allocated.
The portable TCP transport (tcp.py) is the first; RDMA transports (NIXL, Mooncake, MoRI) implement
the same methods, reading and writing `KVCacheAccess.caches` directly instead of through host
bytes.

Threading: the engine thread calls every method below; a transport does its I/O on its own
thread(s) and hands results back through `completed()` / `released()`, so the block pool is only
ever touched by the engine thread. The block *bytes* are written by the transport, off the engine
thread, into blocks nobody else uses until the pull is reported done.
"""

from __future__ import annotations

import copy
import math
import os
import select
import threading
import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class PullResult:
    """A finished pull: its bytes are in the local blocks (`error` None), or it failed. Reported
    only once the transport no longer touches those blocks (device copies included)."""

    transfer_id: str
    error: str | None = None
    nbytes: int = 0


@dataclass(frozen=True)
class RemoteBlocks:
    """Where a consumer pulls from, and which of the producer's blocks it wants.

    `heads`: the KV heads [first, end) of each block to read, in the producer rank's cache (None:
    all of them); `local_heads`: where they go in the consumer's cache (None: all of its heads).
    `pull_id` names the pull in `completed()` (default: the transfer id; one transfer read from
    several producer ranks is several pulls). `tp_size`: the producer's tensor-parallel size."""

    transfer_id: str
    host: str
    port: int
    block_ids: list[int]
    heads: tuple[int, int] | None = None
    local_heads: tuple[int, int] | None = None
    pull_id: str = ""
    tp_size: int = 1

    @property
    def key(self) -> str:
        return self.pull_id or self.transfer_id


class KVConnector(ABC):
    engine_id: str

    # -- producer --------------------------------------------------------------------------------

    @abstractmethod
    def address(self) -> tuple[str, int]:
        """The (host, port) consumers pull from."""

    @abstractmethod
    def offer(self, transfer_id: str, block_ids: list[int]) -> None:
        """Serve reads of these blocks under `transfer_id` until `withdraw`."""

    @abstractmethod
    def withdraw(self, transfer_id: str) -> bool:
        """Stop serving `transfer_id`; False while a read of it is in progress (try again)."""

    @abstractmethod
    def released(self) -> list[str]:
        """Transfer ids whose consumer said it is done with them (success or abort)."""

    # -- consumer --------------------------------------------------------------------------------

    @abstractmethod
    def start_pull(
        self, remote: RemoteBlocks, local_block_ids: list[int], timeout_s: float
    ) -> None:
        """Begin pulling `remote.block_ids` into `local_block_ids` (same length, same order); the
        outcome comes back from `completed()`, an error after timeout_s."""

    @abstractmethod
    def cancel_pull(self, transfer_id: str) -> bool:
        """Stop a pull; a late answer is dropped. True when the transport no longer touches the
        pull's local blocks (the caller may free them now); False while a write into them is
        being stopped: a `PullResult` with an error then comes from `completed()`, after which
        they may be freed."""

    @abstractmethod
    def release_remote(self, host: str, port: int, transfer_id: str) -> None:
        """Tell a producer its held blocks for `transfer_id` are no longer needed."""

    @abstractmethod
    def completed(self) -> list[PullResult]:
        """Pulls finished (or failed) since the last call."""

    def plan_error(self, producer_tp: int) -> str | None:
        """Why blocks of a producer at this tensor-parallel size cannot be pulled (None: they
        can). A single transport reads one producer rank."""
        if producer_tp == 1:
            return None
        return f"this transport reads one rank, the prefill engine has {producer_tp}"

    # -- both ------------------------------------------------------------------------------------

    @abstractmethod
    def wait(self, timeout_s: float) -> None:
        """Block up to timeout_s or until the transport has something for the engine."""

    @abstractmethod
    def close(self) -> None: ...


class Wakeup:
    """threading.Event's set/wait/clear over a pipe, so a ZMQ poller can wait on it beside
    sockets (`fileno`): a transport's threads set it when they have news for the engine."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._lock = threading.Lock()
        self._set = False

    def fileno(self) -> int:
        return self._read

    def set(self) -> None:
        with self._lock:
            if self._set:
                return
            self._set = True
            try:
                os.write(self._write, b"x")
            except BlockingIOError:
                pass  # already readable

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout_s: float) -> bool:
        if not self._set:
            select.select([self._read], [], [], max(0.0, timeout_s))
        return self._set

    def clear(self) -> None:
        with self._lock:
            self._set = False
            try:
                while os.read(self._read, 4096):
                    pass
            except BlockingIOError:
                pass

    def close(self) -> None:
        os.close(self._read)
        os.close(self._write)


def plan_stripes(num_units: int, streams: int) -> list[tuple[int, int]]:
    """Cut units [0, num_units) into min(streams, num_units) contiguous stripes [start, end)
    whose sizes differ by at most one unit. Producer and consumer compute the same plan."""
    if num_units < 1 or streams < 1:
        raise ValueError(f"plan_stripes: {num_units} units over {streams} streams")
    count = min(streams, num_units)
    return [(i * num_units // count, (i + 1) * num_units // count) for i in range(count)]


def unit_runs(block_ids: list[int], start: int, end: int) -> list[tuple[int, int, int]]:
    """Units [start, end) of a payload over `block_ids` as (cache, first block id, count) runs of
    consecutive block ids, in wire order. Unit u is block `block_ids[u % n]` of cache `u // n`
    (the caches of every layer in order: a layer's K then V, or its one latent cache)."""
    runs: list[tuple[int, int, int]] = []
    for cache, j0, j1 in cache_segments(len(block_ids), start, end):
        first, count = block_ids[j0], 1
        for block in block_ids[j0 + 1 : j1]:
            if block == first + count:
                count += 1
            else:
                runs.append((cache, first, count))
                first, count = block, 1
        runs.append((cache, first, count))
    return runs


def cache_segments(num_blocks: int, start: int, end: int) -> list[tuple[int, int, int]]:
    """Units [start, end) cut where the cache changes: (cache, first position, end position)."""
    out = []
    u = start
    while u < end:
        cache, j = divmod(u, num_blocks)
        stop = min(end - u + j, num_blocks)
        out.append((cache, j, stop))
        u += stop - j
    return out


class KVCacheAccess:
    """The paged KV cache of one engine rank (every attention layer's cache tensors, as its
    `cache_spec` lists them: K and V, or MLA's one latent cache) as block bytes.

    Wire layout of n blocks: [layer][cache tensor][block][block_size][*token_shape], contiguous,
    in the cache dtype: [layer][k|v][block][block_size][kv_heads][head_dim] for ordinary
    attention, [layer][block][block_size][kv_lora_rank + rope] for MLA. Both ends must agree on
    `layout`, which names the cache kind and the model's KV heads (not a rank's); a consumer
    refuses a mismatch. A *unit* is one block of one cache (`unit_bytes`); a payload of n blocks
    is `caches a layer * layers * n` units.

    `restrict((first, end))` is the same cache seen through KV heads [first, end) of this rank's
    (a transfer between engines of different tensor-parallel sizes moves a head slice of each
    block): its units are that slice of each block, in the same order.

    Two ways to move units: `direct` (a contiguous CPU cache) hands out memoryviews of the
    blocks themselves, so sockets read and write the cache with no copy; otherwise (a GPU cache)
    `gather`/`scatter` copy units between the cache and a host buffer on a side stream.

    `kv_heads`: the model's KV heads over all ranks (default: this rank's, i.e. one rank);
    `state_layout`: a hybrid model's checkpoint layout id, which both ends must share too."""

    def __init__(
        self,
        layers: list,
        direct: bool | None = None,
        *,
        kv_heads: int | None = None,
        state_layout: str | None = None,
    ) -> None:
        if not layers:
            raise ValueError("KVCacheAccess: the model has no attention layers")
        self.layers = layers
        self.kind = layers[0].cache_spec().kind
        if any(layer.cache_spec().kind != self.kind for layer in layers):
            raise ValueError("KVCacheAccess: the attention layers keep caches of different kinds")
        self.full_caches = [c for layer in layers for c in layer.cache_tensors()]
        k = self.full_caches[0]
        if any(tuple(c.shape[1:]) != tuple(k.shape[1:]) for c in self.full_caches):
            raise ValueError("KVCacheAccess: the cache tensors differ in block shape")
        # An ordinary cache's token entry is [kv_heads, head_dim]; a latent one has no heads.
        self.local_heads = k.shape[2] if k.dim() == 4 else None
        self.kv_heads = None if self.local_heads is None else (kv_heads or self.local_heads)
        self.state_layout = state_layout
        self.dtype = k.dtype
        self.device = k.device
        self.heads: tuple[int, int] | None = None
        self._set_view(self.full_caches)
        can_direct = self.device.type == "cpu" and all(c.is_contiguous() for c in self.full_caches)
        if direct is None:
            direct = can_direct
        elif direct and not can_direct:
            raise ValueError("KVCacheAccess: direct access needs contiguous CPU caches")
        self.direct = direct
        self._bytes = (
            [memoryview(c.view(torch.uint8).reshape(-1).numpy()) for c in self.full_caches]
            if direct
            else []
        )
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def _set_view(self, caches: list[torch.Tensor]) -> None:
        self.caches = caches
        self.block_shape = tuple(caches[0].shape[1:])  # (block_size, *token_shape)
        # Blocks move as bytes (index_select / index_copy_ have no FP8 kernels, and a copy
        # needs no arithmetic): each cache viewed as uint8, its last dim in bytes.
        self._byte_caches = [c.view(torch.uint8) for c in caches]
        self.unit_bytes = math.prod(self.block_shape) * caches[0].element_size()
        self.block_bytes = len(caches) * self.unit_bytes

    def restrict(self, heads: tuple[int, int] | None) -> KVCacheAccess:
        """This cache seen through KV heads [first, end) of this rank's (None: all of them).
        ValueError when the range is not inside this rank's heads."""
        if heads is None or (self.local_heads is not None and heads == (0, self.local_heads)):
            return self
        first, end = heads
        if self.local_heads is None or not 0 <= first < end <= self.local_heads:
            raise ValueError(
                f"KV heads {list(heads)} are not within this rank's "
                f"{self.local_heads or 0} heads of a {self.kind} cache"
            )
        view = copy.copy(self)
        view.heads = (first, end)
        view._set_view([c[:, :, first:end] for c in self.full_caches])
        return view

    @property
    def layout(self) -> str:
        """A string both ends compare: layers, cache kind (`kv`, `mla_latent`) and tensors a
        layer, block shape with the model's KV heads (not a rank's), dtype, and a hybrid model's
        state layout: `28L/kv:2/16x8x128/bfloat16`, `61L/mla_latent:1/16x576/bfloat16`,
        `24L/kv:2/16x2x64/float32/state:<id>`. An FP8 cache (`.../float8_e4m3fn`) whose k/v
        scales are not all 1.0 adds a digest of them (`/scales:1a2b3c4d`): its bytes mean
        K / k_scale, so an engine with other scales must not read them."""
        shape = list(self.full_caches[0].shape[1:])
        if self.local_heads is not None:
            shape[1] = self.kv_heads
        dims = "x".join(str(d) for d in shape)
        per_layer = len(self.full_caches) // len(self.layers)
        dtype = str(self.dtype).removeprefix("torch.")
        out = f"{len(self.layers)}L/{self.kind}:{per_layer}/{dims}/{dtype}"
        scales = [(getattr(x, "k_scale", 1.0), getattr(x, "v_scale", 1.0)) for x in self.layers]
        if self.dtype.itemsize == 1 and any(s != (1.0, 1.0) for s in scales):
            out += f"/scales:{zlib.crc32(repr(scales).encode()):08x}"
        return out if self.state_layout is None else f"{out}/state:{self.state_layout}"

    @property
    def pin(self) -> bool:
        """Whether host buffers for this cache should be pinned (a GPU cache)."""
        return self._copy_stream is not None

    def num_units(self, num_blocks: int) -> int:
        return len(self.caches) * num_blocks

    def fence(self):
        """Engine thread: a CUDA event after the compute stream's work so far (None on CPU).
        Side-stream copies wait for it, so they never race a step still in flight that touched
        the same blocks under an earlier owner."""
        if self._copy_stream is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def views(self, block_ids: list[int], start: int, end: int) -> list[memoryview]:
        """Direct access: units [start, end) as writable views of the cache memory, in wire
        order (consecutive blocks merged; a head slice is a view per token row)."""
        if not self.direct:
            raise RuntimeError("KVCacheAccess.views: this cache is not directly accessible")
        runs = unit_runs(block_ids, start, end)
        if self.heads is None:
            ub = self.unit_bytes
            return [self._bytes[c][first * ub : (first + n) * ub] for c, first, n in runs]
        full = self.full_caches[0]
        row = full[0, 0].numel() * full.element_size()  # one token of every head
        head = row // self.local_heads
        span = (self.heads[1] - self.heads[0]) * head
        block = self.block_shape[0] * row
        offset = self.heads[0] * head
        return [
            self._bytes[c][at : at + span]
            for c, first, n in runs
            for at in range(first * block + offset, (first + n) * block, row)
        ]

    def block_index(self, block_ids: list[int]) -> torch.Tensor:
        """`block_ids` as the index tensor `gather`/`scatter` take (on the device, queued on the
        side stream), made once per stripe."""
        if self._copy_stream is None:
            return torch.tensor(block_ids, dtype=torch.long)
        with torch.cuda.stream(self._copy_stream):
            return torch.tensor(block_ids, dtype=torch.long, device=self.device)

    def _units(self, host: torch.Tensor, count: int) -> torch.Tensor:
        shape = self._byte_caches[0].shape[1:]
        return host[: count * self.unit_bytes].view(count, *shape)

    def gather(self, index: torch.Tensor, start: int, end: int, host: torch.Tensor, fence=None):
        """Copy units [start, end) of the payload over `index` (`block_index`) into the uint8
        tensor `host` (pinned for a GPU cache). On a GPU the copy runs on the side stream and the
        returned CUDA event marks its end (`host` must stay untouched until then); on a CPU it is
        done on return (None)."""
        out = self._units(host, end - start)
        n = len(index)
        if self._copy_stream is None:
            for cache, j0, j1 in cache_segments(n, start, end):
                at = cache * n + j0 - start
                torch.index_select(
                    self._byte_caches[cache], 0, index[j0:j1], out=out[at : at + j1 - j0]
                )
            return None
        with torch.cuda.stream(self._copy_stream):
            if fence is not None:
                self._copy_stream.wait_event(fence)
            staged = torch.empty(out.shape, dtype=torch.uint8, device=self.device)
            for cache, j0, j1 in cache_segments(n, start, end):
                at = cache * n + j0 - start
                torch.index_select(
                    self._byte_caches[cache], 0, index[j0:j1], out=staged[at : at + j1 - j0]
                )
            out.copy_(staged, non_blocking=True)
            done = torch.cuda.Event(blocking=True)  # a worker waits on it: sleep, not spin
            done.record(self._copy_stream)
        return done

    def scatter(self, index: torch.Tensor, start: int, end: int, host: torch.Tensor, fence=None):
        """Copy units [start, end) of the payload over `index` (`block_index`) from the uint8
        tensor `host` into the cache blocks; on a GPU on the side stream, returning the CUDA
        event that marks its end (`host` must stay untouched until then), on a CPU done on
        return (None)."""
        src = self._units(host, end - start)
        n = len(index)
        if self._copy_stream is None:
            for cache, j0, j1 in cache_segments(n, start, end):
                at = cache * n + j0 - start
                self._byte_caches[cache].index_copy_(0, index[j0:j1], src[at : at + j1 - j0])
            return None
        with torch.cuda.stream(self._copy_stream):
            if fence is not None:
                self._copy_stream.wait_event(fence)
            staged = src.to(self.device, non_blocking=True)
            for cache, j0, j1 in cache_segments(n, start, end):
                at = cache * n + j0 - start
                self._byte_caches[cache].index_copy_(0, index[j0:j1], staged[at : at + j1 - j0])
            done = torch.cuda.Event(blocking=True)  # a worker waits on it: sleep, not spin
            done.record(self._copy_stream)
        return done

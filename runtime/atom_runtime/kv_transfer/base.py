"""The one seam between the engine and a KV transport, and the engine's KV cache as bytes.

A transport moves whole KV blocks from a producer engine (it computed a prompt) to a consumer
engine (it will decode that prompt). Block bookkeeping (which blocks are held, when they are
released, what a consumer lacks) lives in `TransferAgent` and is the same for every transport;
a transport only serves reads of held blocks and performs pulls. The portable TCP transport
(tcp.py) is the first; RDMA transports (NIXL, Mooncake, MoRI) implement the same methods, reading
and writing `KVCacheAccess`'s registered tensors directly instead of through host bytes.

Threading: the engine thread calls every method below; a transport does its I/O on its own
thread(s) and hands results back through `completed()` / `released()`, so the block pool is only
ever touched by the engine thread.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class PullResult:
    """A finished pull: the raw block bytes (layout per `KVCacheAccess.layout`) or an error."""

    transfer_id: str
    payload: memoryview | bytes | None
    error: str | None = None


@dataclass(frozen=True)
class RemoteBlocks:
    """Where a consumer pulls from, and which of the producer's blocks it wants."""

    transfer_id: str
    host: str
    port: int
    block_ids: list[int]


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
    def start_pull(self, remote: RemoteBlocks, timeout_s: float) -> None:
        """Begin pulling; the outcome comes back from `completed()`, an error after timeout_s."""

    @abstractmethod
    def cancel_pull(self, transfer_id: str) -> None:
        """Forget a pull; a late answer is dropped."""

    @abstractmethod
    def release_remote(self, host: str, port: int, transfer_id: str) -> None:
        """Tell a producer its held blocks for `transfer_id` are no longer needed."""

    @abstractmethod
    def completed(self) -> list[PullResult]:
        """Pulls finished (or failed) since the last call."""

    # -- both ------------------------------------------------------------------------------------

    @abstractmethod
    def wait(self, timeout_s: float) -> None:
        """Block up to timeout_s or until the transport has something for the engine."""

    @abstractmethod
    def close(self) -> None: ...


class KVCacheAccess:
    """The paged KV cache of one engine (every attention layer's K and V) as block bytes.

    Wire layout of n blocks: [layer][k|v][block][block_size][kv_heads][head_dim], contiguous, in
    the cache dtype. Both ends must agree on `layout`; a consumer refuses a mismatch."""

    def __init__(self, layers: list) -> None:
        if not layers:
            raise ValueError("KVCacheAccess: the model has no attention layers")
        self.layers = layers
        k = layers[0].k_cache
        self.block_shape = tuple(k.shape[1:])  # (block_size, kv_heads, head_dim)
        self.dtype = k.dtype
        self.device = k.device
        self.block_bytes = 2 * len(layers) * k[0].numel() * k.element_size()
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    @property
    def layout(self) -> str:
        """A string both ends compare: layers, block shape and dtype."""
        dims = "x".join(str(d) for d in self.block_shape)
        return f"{len(self.layers)}L/2/{dims}/{str(self.dtype).removeprefix('torch.')}"

    def read(self, block_ids: list[int]) -> memoryview:
        """Copy the blocks to host memory (pinned on a GPU, on a side stream, so the copy
        overlaps the compute stream); safe from a transport thread while the blocks are held."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        caches = [c for layer in self.layers for c in (layer.k_cache, layer.v_cache)]
        shape = (len(caches), len(block_ids), *self.block_shape)
        if self._copy_stream is None:
            host = torch.empty(shape, dtype=self.dtype)
            for i, cache in enumerate(caches):  # gathered straight into the output: one copy
                torch.index_select(cache, 0, index, out=host[i])
        else:
            with torch.cuda.stream(self._copy_stream):
                gathered = torch.empty(shape, dtype=self.dtype, device=self.device)
                for i, cache in enumerate(caches):
                    torch.index_select(cache, 0, index, out=gathered[i])
                host = torch.empty(shape, dtype=self.dtype, pin_memory=True)
                host.copy_(gathered, non_blocking=True)
            self._copy_stream.synchronize()
        return memoryview(host.view(torch.uint8).numpy()).cast("B")

    def write(self, block_ids: list[int], payload: memoryview | bytes) -> None:
        """Place pulled blocks into the cache (engine thread, between steps)."""
        n = len(block_ids)
        if len(payload) != n * self.block_bytes:
            raise ValueError(
                f"KV payload of {len(payload)} bytes for {n} blocks of {self.block_bytes} bytes"
            )
        with warnings.catch_warnings():
            # The received frame is read-only; it is only ever read from here.
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(payload, dtype=torch.uint8)
        blocks = flat.view(self.dtype).view(2 * len(self.layers), n, *self.block_shape)
        if self.device.type == "cuda":
            blocks = blocks.pin_memory().to(self.device, non_blocking=True)
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for i, layer in enumerate(self.layers):
            layer.k_cache.index_copy_(0, index, blocks[2 * i])
            layer.v_cache.index_copy_(0, index, blocks[2 * i + 1])

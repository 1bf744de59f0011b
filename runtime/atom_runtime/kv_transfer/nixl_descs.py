"""NIXL descriptors for a read of KV blocks: exactly the blocks, and the heads, one pull needs.

A cache rank registers each cache tensor once ([num_blocks, block_size, *token_shape],
contiguous). `CacheGeometry` is what a reader needs to address them: each tensor's base address,
the bytes of one block and of one token row, and of one KV head within a row. The producer sends
its geometry in every grant; the consumer builds both descriptor lists of a read with
`read_descriptors` (numpy, no Python loop over blocks):

- whole blocks (both sides hold the same heads): one descriptor per run of blocks consecutive on
  both sides, per cache tensor;
- a head slice (engines of different tensor-parallel sizes): per cache tensor and block, the
  slice's bytes of each of its block_size token rows, as NIXL's strided descriptors
  (address, length, device, stride, count), which NIXL expands to `count` descriptors.

Both lists pair up entry by entry, equal in length, in the same order: the read is one transfer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from atom_runtime.kv_transfer.base import KVCacheAccess


@dataclass(frozen=True)
class CacheGeometry:
    regions: list[int]  # base address of each cache tensor, in layout order
    device: int  # the GPU's index (VRAM); 0 for host memory
    memory: str  # "VRAM" or "DRAM", NIXL's names
    block_bytes: int  # one block of one cache tensor
    row_bytes: int  # one token of one block: every head of this rank
    head_bytes: int  # one KV head of one token (0: a cache without heads)
    block_size: int

    @classmethod
    def of(cls, kv: KVCacheAccess) -> CacheGeometry:
        first = kv.full_caches[0]
        block_bytes = first[0].numel() * first.element_size()
        row_bytes = block_bytes // first.shape[1]
        cuda = first.device.type == "cuda"
        return cls(
            regions=[c.data_ptr() for c in kv.full_caches],
            device=(first.device.index or 0) if cuda else 0,
            memory="VRAM" if cuda else "DRAM",
            block_bytes=block_bytes,
            row_bytes=row_bytes,
            head_bytes=row_bytes // kv.local_heads if kv.local_heads else 0,
            block_size=first.shape[1],
        )

    def span(self, heads: tuple[int, int] | None) -> tuple[int, int]:
        """(offset in a token row, length) of these heads (None: the whole row)."""
        if heads is None:
            return 0, self.row_bytes
        return heads[0] * self.head_bytes, (heads[1] - heads[0]) * self.head_bytes


def read_descriptors(
    local: CacheGeometry,
    remote: CacheGeometry,
    local_ids: list[int],
    remote_ids: list[int],
    src: tuple[int, int] | None = None,
    dst: tuple[int, int] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(local, remote) descriptor arrays of a read of heads `src` of the remote blocks into heads
    `dst` of the local ones (None: all heads of that side). ValueError when the two sides do not
    describe the same bytes."""
    if len(local_ids) != len(remote_ids) or not local_ids:
        raise ValueError(f"{len(remote_ids)} remote blocks into {len(local_ids)} local ones")
    if len(local.regions) != len(remote.regions) or local.block_size != remote.block_size:
        raise ValueError(
            f"the producer's cache has {len(remote.regions)} tensors of {remote.block_size}-token "
            f"blocks, this one {len(local.regions)} of {local.block_size}"
        )
    loff, llen = local.span(dst)
    roff, rlen = remote.span(src)
    if llen != rlen:
        raise ValueError(f"the producer's rows hold {rlen} bytes of these heads, this one {llen}")
    lids = np.asarray(local_ids, dtype=np.uint64)
    rids = np.asarray(remote_ids, dtype=np.uint64)
    if llen == local.row_bytes and rlen == remote.row_bytes:
        return _whole_blocks(local, remote, lids, rids)
    return (
        _rows(local, lids, loff, llen),
        _rows(remote, rids, roff, rlen),
    )


def _whole_blocks(local, remote, lids, rids) -> tuple[np.ndarray, np.ndarray]:
    """One descriptor per cache tensor and run of blocks consecutive on both sides."""
    one = np.uint64(1)
    breaks = np.flatnonzero((np.diff(lids) != one) | (np.diff(rids) != one)) + 1
    starts = np.concatenate([[0], breaks])
    counts = np.diff(np.concatenate([starts, [len(lids)]])).astype(np.uint64)
    out = []
    for geo, ids in ((local, lids), (remote, rids)):
        bb = np.uint64(geo.block_bytes)
        bases = np.asarray(geo.regions, dtype=np.uint64)[:, None]
        addr = (bases + ids[starts][None, :] * bb).ravel()
        size = np.tile(counts * bb, len(geo.regions))
        dev = np.full(len(addr), geo.device, dtype=np.uint64)
        out.append(np.stack([addr, size, dev], axis=1))
    return out[0], out[1]


def _rows(geo: CacheGeometry, ids: np.ndarray, offset: int, length: int) -> np.ndarray:
    """Strided descriptors: per cache tensor and block, `block_size` rows of `length` bytes."""
    bases = np.asarray(geo.regions, dtype=np.uint64)[:, None]
    addr = (bases + ids[None, :] * np.uint64(geo.block_bytes) + np.uint64(offset)).ravel()
    n = len(addr)
    return np.stack(
        [
            addr,
            np.full(n, length, dtype=np.uint64),
            np.full(n, geo.device, dtype=np.uint64),
            np.full(n, geo.row_bytes, dtype=np.uint64),
            np.full(n, geo.block_size, dtype=np.uint64),
        ],
        axis=1,
    )

"""An engine's KV transport over all its tensor-parallel ranks: the `KVConnector` the agent uses.

Each rank moves its own shard with its own transport (TCP or NIXL) on its own control port,
kv_port + rank. This connector, on rank 0 beside the agent, fans the agent's calls out:

- producer: a hold is offered on every rank (same block ids everywhere) and withdrawn from every
  rank (not while any rank's blocks are being read); consumers release a transfer on rank 0's
  port, whose releases end holds.
- consumer: a pull becomes one pull per (local rank, producer rank holding its heads), planned by
  `shards.plan_sources` from the producer's tensor-parallel size (`RemoteBlocks.tp_size`); the
  transfer is reported once every one has, with the first error. A failed part cancels its
  siblings. Releases go to rank 0's port and to every other producer rank read from.

With one rank and one source this is a thin pass-through. Worker ranks are reached through
`ranks.LinkedRank`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import zmq

from atom_runtime.kv_transfer.base import KVConnector, PullResult, RemoteBlocks, Wakeup
from atom_runtime.kv_transfer.ranks import LinkPlaces
from atom_runtime.kv_transfer.shards import check_tp, plan_sources


@dataclass
class _Fanned:
    """One transfer's pulls: the ones still owed a result, the first error, the bytes."""

    pending: dict[str, int] = field(default_factory=dict)  # pull key -> local rank
    error: str | None = None
    nbytes: int = 0
    peers: list[tuple[int, str, int]] = field(default_factory=list)  # (local rank, host, port)


class ShardedConnector(KVConnector):
    def __init__(
        self, ranks: list, kv_heads: int | None, wake: Wakeup, links: LinkPlaces | None = None
    ) -> None:
        """`ranks`: every local rank's transport, rank 0's first (the others `LinkedRank`s of
        `links`); `kv_heads`: the model's KV heads (None: a latent cache every rank holds
        whole); `wake`: what rank 0's transport sets when it has news."""
        self.ranks = ranks
        self.kv_heads = kv_heads
        self.wake = wake
        self.links = links
        self.engine_id = ranks[0].engine_id
        self._transfers: dict[str, _Fanned] = {}
        self._peers: dict[str, list[tuple[int, str, int]]] = {}  # released with the transfer
        self._owner: dict[str, str] = {}  # pull key -> transfer id
        self._results: list[PullResult] = []

    @property
    def tp_size(self) -> int:
        return len(self.ranks)

    @property
    def blocks_sent(self) -> int:
        return sum(getattr(r, "blocks_sent", 0) for r in self.ranks)

    @property
    def bytes_sent(self) -> int:
        return sum(getattr(r, "bytes_sent", 0) for r in self.ranks)

    def plan_error(self, producer_tp: int) -> str | None:
        """Why a transfer from a producer of this tensor-parallel size cannot be planned."""
        try:
            if self.kv_heads is not None:
                check_tp(self.kv_heads, producer_tp, "the prefill engine")
            plan_sources(self.kv_heads, producer_tp, self.tp_size, 0)
        except ValueError as e:
            return str(e)
        return None

    # -- producer --------------------------------------------------------------------------------

    def address(self) -> tuple[str, int]:
        return self.ranks[0].address()

    def offer(self, transfer_id: str, block_ids: list[int]) -> None:
        for rank in self.ranks:
            rank.offer(transfer_id, block_ids)

    def withdraw(self, transfer_id: str) -> bool:
        return all([rank.withdraw(transfer_id) for rank in self.ranks])  # ask every rank

    def released(self) -> list[str]:
        return self.ranks[0].released()

    # -- consumer --------------------------------------------------------------------------------

    def start_pull(
        self, remote: RemoteBlocks, local_block_ids: list[int], timeout_s: float
    ) -> None:
        tid = remote.transfer_id
        fanned = _Fanned()
        parts = []
        for r in range(self.tp_size):
            for src in plan_sources(self.kv_heads, remote.tp_size, self.tp_size, r):
                key = f"{tid}/{r}/{src.rank}"
                port = remote.port + src.rank
                part = RemoteBlocks(
                    tid, remote.host, port, remote.block_ids, src.src, src.dst, key, remote.tp_size
                )
                parts.append((r, part))
                fanned.pending[key] = r
                if src.rank:
                    fanned.peers.append((r, remote.host, port))
        self._transfers[tid] = fanned
        for r, part in parts:
            self._owner[part.key] = tid
            self.ranks[r].start_pull(part, local_block_ids, timeout_s)

    def cancel_pull(self, transfer_id: str) -> bool:
        fanned = self._transfers.get(transfer_id)
        if fanned is None:
            return True
        fanned.error = fanned.error or "cancelled"
        self._cancel_parts(fanned)
        if fanned.pending:
            return False  # its last part's result reports the transfer
        self._forget(transfer_id)
        return True

    def release_remote(self, host: str, port: int, transfer_id: str) -> None:
        self.ranks[0].release_remote(host, port, transfer_id)
        for r, h, p in self._peers.pop(transfer_id, []):
            self.ranks[r].release_remote(h, p, transfer_id)

    def completed(self) -> list[PullResult]:
        for rank in self.ranks:
            for result in rank.completed():
                self._take(result)
        out, self._results = self._results, []
        return out

    def _take(self, result: PullResult) -> None:
        tid = self._owner.pop(result.transfer_id, None)
        fanned = self._transfers.get(tid) if tid is not None else None
        if fanned is None or fanned.pending.pop(result.transfer_id, None) is None:
            return
        fanned.nbytes += result.nbytes
        if result.error is not None and fanned.error is None:
            fanned.error = result.error
            self._cancel_parts(fanned)  # the transfer fails: stop its other parts now
        if not fanned.pending:
            self._forget(tid)
            error = fanned.error
            self._results.append(PullResult(tid, error, 0 if error else fanned.nbytes))

    def _cancel_parts(self, fanned: _Fanned) -> None:
        for key, r in list(fanned.pending.items()):
            if self.ranks[r].cancel_pull(key):
                del fanned.pending[key]  # stopped with nothing in flight: no result comes
                self._owner.pop(key, None)

    def _forget(self, transfer_id: str) -> None:
        fanned = self._transfers.pop(transfer_id)
        if fanned.peers:  # until the agent releases the transfer
            self._peers[transfer_id] = fanned.peers

    # -- both ------------------------------------------------------------------------------------

    def wait(self, timeout_s: float) -> None:
        links = [r.sock for r in self.ranks[1:]]
        if not links:
            self.wake.wait(timeout_s)
        elif not self.wake.is_set():
            poller = zmq.Poller()
            poller.register(self.wake, zmq.POLLIN)
            for sock in links:
                poller.register(sock, zmq.POLLIN)
            poller.poll(int(timeout_s * 1000))
        self.wake.clear()

    def close(self) -> None:
        self.ranks[0].close()
        if self.links is not None:
            self.links.close()
        self.wake.close()

"""What every transport's producer keeps about held blocks, and the checks every pull passes.

`OfferBook` is a part of a producer (a mixin, under the connector's `_lock`): the blocks offered
under each transfer id with the CUDA fence recorded when they were offered, how many reads of
each are under way (a transfer being read is never withdrawn), and the transfer ids consumers
released. `pull_error` checks a pull's own fields against this rank's cache before any hold is
looked at; `grant_error` then checks them against the hold. `bind_control` opens a producer's
control port.
"""

from __future__ import annotations

import math

import msgspec
import zmq

from atom_runtime.kv_transfer.base import KVCacheAccess
from atom_runtime.kv_transfer.config import MAX_PULL_TIMEOUT_S, WILDCARDS, KVTransferConfig
from atom_runtime.kv_transfer.wire import Release

# A control message is a pull of at most every block of the pool: a few bytes a block id.
CONTROL_BYTES_PER_BLOCK = 10
CONTROL_SLACK_BYTES = 4096
MAX_TICKETS_PER_PEER = 16  # pulls (TCP tickets, NIXL reads) one consumer may have granted at once


def bind_control(ctx: zmq.Context, config: KVTransferConfig, num_blocks: int) -> zmq.Socket:
    """The producer's control ROUTER on kv_port, on the pod's address unless kv_ip asks for
    another (a wildcard only when given); ZMQ drops a peer sending a message larger than a pull
    of the whole pool. ValueError naming kv_port when it cannot listen."""
    ip = config.bind_host()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.MAXMSGSIZE, CONTROL_SLACK_BYTES + CONTROL_BYTES_PER_BLOCK * num_blocks)
    host = "*" if ip in WILDCARDS else f"[{ip}]" if ":" in ip else ip
    try:
        router.bind(f"tcp://{host}:{config.kv_port}")
    except zmq.ZMQError as e:
        router.close()
        raise ValueError(
            f"kv_transfer_config.kv_port: cannot listen on {host}:{config.kv_port} ({e})"
        ) from None
    return router


class OfferBook:
    """Needs the connector's `_lock`, `_wake`, `_wire` (decoder), `_encoder`, `seal`, `_warn`,
    `kv`, and `_grant(request, peer)` answering a transport's pull request."""

    def _init_offers(self) -> None:
        self._offers: dict[str, tuple[set[int], object]] = {}  # transfer id -> (blocks, fence)
        self._reading: dict[str, int] = {}
        self._released: list[str] = []

    # -- engine thread ---------------------------------------------------------------------------

    def offer(self, transfer_id: str, block_ids: list[int]) -> None:
        fence = self.kv.fence()
        with self._lock:
            self._offers[transfer_id] = (set(block_ids), fence)

    def withdraw(self, transfer_id: str) -> bool:
        with self._lock:
            if self._reading.get(transfer_id):
                return False
            self._offers.pop(transfer_id, None)
            return True

    def released(self) -> list[str]:
        with self._lock:
            out, self._released = self._released, []
        return out

    # -- control thread --------------------------------------------------------------------------

    def _serve(self, router: zmq.Socket) -> None:
        """Answer every request waiting on the control port: a Release is recorded, anything
        else the wire decodes is a pull, answered (sealed, its nonce echoed) by `_grant`."""
        while True:
            try:
                frames = router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) != 2:
                self._warn("ignoring a %d-frame message on the KV control port", len(frames))
                continue
            ident, raw = frames
            peer = _peer_address(raw)
            try:
                msg = self._wire.decode(raw.buffer)
            except msgspec.DecodeError:
                self._warn("ignoring an undecodable KV transfer message from %s", peer)
                continue
            if isinstance(msg, Release):
                error = self.seal.check(msg)
                if error is not None:
                    self._warn("ignoring a KV release from %s: %s", peer, error)
                    continue
                with self._lock:
                    self._on_release(msg.transfer_id)
                self._wake.set()
            elif hasattr(msg, "block_ids"):  # a pull request
                reply = self._grant(msg, peer)
                if reply.error is not None:
                    self._warn("refused a KV pull from %s: %s", peer, reply.error)
                reply.nonce = msg.nonce
                router.send_multipart([ident.bytes, self._encoder.encode(self.seal.seal(reply))])

    def _on_release(self, transfer_id: str) -> None:
        """Under the lock: the consumer is done with transfer_id."""
        self._released.append(transfer_id)

    # -- under the lock --------------------------------------------------------------------------

    def _start_read(self, transfer_id: str) -> None:
        self._reading[transfer_id] = self._reading.get(transfer_id, 0) + 1

    def _end_read(self, transfer_id: str) -> None:
        self._reading[transfer_id] -= 1
        if not self._reading[transfer_id]:
            del self._reading[transfer_id]

    def _grant_error(self, transfer_id: str, block_ids: list[int]) -> tuple[str | None, object]:
        """Why a pull of these blocks under transfer_id cannot be granted (None: it can), and
        the hold's fence."""
        offer = self._offers.get(transfer_id)
        if offer is None:
            return f"transfer {transfer_id} is unknown here (released or timed out)", None
        offered, fence = offer
        if not set(block_ids) <= offered:
            missing = sorted(set(block_ids) - offered)[:8]
            return f"transfer {transfer_id}: blocks {missing} not held", None
        return None, fence


def refused_pull(msg, seal, kv: KVCacheAccess, protocol: int, transport: str) -> str | None:
    """Why a producer refuses a pull before looking at its holds (None: it does not): another
    protocol version, a missing or wrong seal, or its own fields (`pull_error`)."""
    if msg.version != protocol:
        return (
            f"the consumer speaks {transport} protocol {msg.version}, this producer "
            f"{protocol}: run the same ATOM version on prefill and decode engines"
        )
    return seal.check(msg) or pull_error(kv, msg.layout, msg.timeout_s, msg.block_ids, msg.heads)


def pull_error(
    kv: KVCacheAccess,
    layout: str,
    timeout_s: float,
    block_ids: list[int],
    heads: tuple[int, int] | None,
) -> str | None:
    """What is wrong with a pull's own fields (before any hold is looked at), or None."""
    if layout != kv.layout:
        return f"KV layout {layout} does not match this engine's {kv.layout}"
    t = timeout_s
    if isinstance(t, bool) or not math.isfinite(t) or not 0 < t <= MAX_PULL_TIMEOUT_S:
        return f"timeout_s must be a number of seconds in (0, {MAX_PULL_TIMEOUT_S:g}], got {t!r}"
    if not block_ids:
        return "no blocks asked for"
    if len(set(block_ids)) != len(block_ids):
        return "a block id asked for twice"
    if heads is not None:
        try:
            kv.restrict(tuple(heads))
        except (ValueError, TypeError) as e:
            return str(e)
    return None


def _peer_address(frame: zmq.Frame) -> str:
    try:
        return frame.get("Peer-Address")
    except (zmq.ZMQError, AttributeError):
        return "?"

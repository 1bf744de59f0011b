"""The link between an engine's transfer agent (tensor-parallel rank 0, in the engine-core
process) and the transports of its other ranks (one per worker process).

Each rank moves its own shard of the KV cache with a transport of its own (a `KVConnector` over
its `KVCacheAccess`, on its own control port). Rank 0's `ShardedConnector` drives them: its own
directly, a worker's through a `LinkedRank`, which forwards each call over a ZMQ PAIR socket to
that worker's `RankService` thread. Calls whose answer the engine needs (offer, withdraw,
cancel_pull) wait for it; the rest are fire-and-forget. The service sends finished pulls back as
they come, with the rank's sent counters.

The sockets are ipc:// endpoints in a directory only this user can open (the ranks of one engine
share a host); messages are msgspec msgpack lists, never pickle.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import shutil
import tempfile
import threading
import time

import msgspec
import zmq

from atom_runtime.kv_transfer.base import KVConnector, PullResult, RemoteBlocks, Wakeup

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 30.0  # a worker's transport that does not answer a call within this is gone
POLL_MS = 100
_CALLS = {"offer": "offer", "withdraw": "withdraw", "cancel": "cancel_pull"}  # link -> method


def _remote_fields(remote: RemoteBlocks) -> list:
    return list(dataclasses.astuple(remote))


def _remote_from(fields: list) -> RemoteBlocks:
    tid, host, port, ids, heads, local_heads, pull_id, tp_size = fields
    return RemoteBlocks(
        tid,
        host,
        port,
        list(ids),
        tuple(heads) if heads is not None else None,
        tuple(local_heads) if local_heads is not None else None,
        pull_id,
        tp_size,
    )


class LinkPlaces:
    """Where rank 0 listens for each worker rank's service: one ipc:// endpoint per rank in a
    private directory, removed at close."""

    def __init__(self, ranks: list[int]) -> None:
        self._ctx = ctx = zmq.Context()
        self.folder = tempfile.mkdtemp(prefix="atom-kv-ranks-")  # mode 0700
        self.links = {}
        for rank in ranks:
            sock = ctx.socket(zmq.PAIR)
            sock.setsockopt(zmq.LINGER, 0)
            address = f"ipc://{os.path.join(self.folder, f'r{rank}')}"
            sock.bind(address)
            self.links[rank] = LinkedRank(rank, sock, address)

    def close(self) -> None:
        for link in self.links.values():
            link.close()
        self._ctx.term()
        shutil.rmtree(self.folder, ignore_errors=True)


class LinkedRank:
    """Rank 0's stand-in for a worker rank's transport; used by the engine thread only."""

    def __init__(self, rank: int, sock: zmq.Socket, address: str) -> None:
        self.rank, self.sock, self.address = rank, sock, address
        self.results: list[PullResult] = []
        self.blocks_sent = self.bytes_sent = 0
        self._ids = itertools.count(1)
        self._encoder = msgspec.msgpack.Encoder()

    def offer(self, transfer_id: str, block_ids: list[int]) -> None:
        self._call("offer", transfer_id, list(block_ids))

    def withdraw(self, transfer_id: str) -> bool:
        return bool(self._call("withdraw", transfer_id))

    def released(self) -> list[str]:
        return []  # a worker rank's releases only end its own reads; rank 0's end holds

    def start_pull(self, remote: RemoteBlocks, local_ids: list[int], timeout_s: float) -> None:
        self._send(["pull", _remote_fields(remote), list(local_ids), timeout_s])

    def cancel_pull(self, key: str) -> bool:
        return bool(self._call("cancel", key))

    def release_remote(self, host: str, port: int, transfer_id: str) -> None:
        self._send(["release", host, port, transfer_id])

    def completed(self) -> list[PullResult]:
        self.drain()
        out, self.results = self.results, []
        return out

    def drain(self, until_call: int | None = None):
        """Take every waiting message; returns the answer to call `until_call` if it came."""
        answer = None
        while True:
            try:
                msg = msgspec.msgpack.decode(self.sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                return answer
            self.blocks_sent, self.bytes_sent = msg[-1]
            if msg[0] == "results":
                self.results.extend(PullResult(*r) for r in msg[1])
            elif msg[0] == "answer" and msg[1] == until_call:
                answer = (msg[2],)

    def _send(self, msg: list) -> None:
        self.sock.send(self._encoder.encode(msg))

    def _call(self, method: str, *args):
        call_id = next(self._ids)
        self._send(["call", call_id, method, *args])
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.sock.poll(POLL_MS):
                answer = self.drain(call_id)
                if answer is not None:
                    return answer[0]
        raise RuntimeError(
            f"tensor-parallel rank {self.rank}'s KV transport did not answer {method} within "
            f"{CALL_TIMEOUT_S:g} s"
        )

    def close(self) -> None:
        try:
            self.sock.send(self._encoder.encode(["stop"]), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        self.sock.close(linger=0)


class RankService:
    """A worker rank's side: runs its transport for rank 0, on a thread of its own."""

    def __init__(self, connector: KVConnector, address: str, wake: Wakeup) -> None:
        self.connector, self.address, self.wake = connector, address, wake
        self._ctx = zmq.Context()
        self._encoder = msgspec.msgpack.Encoder()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-rank-link", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        sock = self._ctx.socket(zmq.PAIR)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(self.address)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self.wake, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(POLL_MS))
                if sock in events and not self._on_link(sock):
                    return
                if self.wake.is_set() or self.wake.fileno() in events:
                    self.wake.clear()
                    self.connector.released()  # rank 0 ends holds; these only end reads
                    results = self.connector.completed()
                    if results:
                        rows = [[r.transfer_id, r.error, r.nbytes] for r in results]
                        sock.send(self._encoder.encode(["results", rows, self._counters()]))
        except Exception:
            log.exception("the KV transfer link of this rank failed")
        finally:
            sock.close()

    def _on_link(self, sock: zmq.Socket) -> bool:
        while True:
            try:
                msg = msgspec.msgpack.decode(sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                return True
            c = self.connector
            if msg[0] == "stop":
                return False
            if msg[0] == "pull":
                c.start_pull(_remote_from(msg[1]), msg[2], msg[3])
            elif msg[0] == "release":
                c.release_remote(msg[1], msg[2], msg[3])
            elif msg[0] == "call":
                call_id, method, args = msg[1], msg[2], msg[3:]
                value = getattr(c, _CALLS[method])(*args)
                sock.send(self._encoder.encode(["answer", call_id, value, self._counters()]))

    def _counters(self) -> list[int]:
        c = self.connector
        return [getattr(c, "blocks_sent", 0), getattr(c, "bytes_sent", 0)]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.connector.close()
        self._ctx.term()
        self.wake.close()

"""What both transports' consumers share: a pull's job made from its checked block lists, the
engine thread's start_pull and completed (PullBook), the DEALER to a producer's control port,
and the messages waiting on a socket."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TypeVar

import zmq

from atom_runtime.kv_transfer.base import KVCacheAccess, PullResult, RemoteBlocks


@dataclass(eq=False)
class PullJob:
    """One pull, from start_pull until it is reported (its fields under the connector's lock);
    each transport adds what it tracks."""

    remote: RemoteBlocks
    local_ids: list[int]
    deadline: float
    fence: object  # CUDA event the side-stream writes wait for, or None
    kv: KVCacheAccess  # the local cache, seen through the heads this pull writes
    nonce: bytes = b""  # of the pull sent: the answer must echo it
    error: str | None = None
    quiet: bool = False  # cancelled with nothing in flight: cancel_pull said so, no result
    reported: bool = False


Job = TypeVar("Job", bound=PullJob)


def new_pull_job(
    job_type: type[Job],
    kv: KVCacheAccess,
    remote: RemoteBlocks,
    local_block_ids: list[int],
    timeout_s: float,
) -> Job:
    """A pull's job: the remote blocks, the local ones (as many, at least one; ValueError
    otherwise), its deadline, the cache's fence and the cache seen through the heads it writes."""
    if len(local_block_ids) != len(remote.block_ids) or not local_block_ids:
        raise ValueError(
            f"start_pull: {len(remote.block_ids)} remote blocks into "
            f"{len(local_block_ids)} local ones"
        )
    deadline = time.monotonic() + timeout_s
    view = kv.restrict(remote.local_heads)
    return job_type(remote, list(local_block_ids), deadline, kv.fence(), view)


class PullBook:
    """The engine-thread calls both consumers answer alike. The consumer holds `kv`, `_lock`,
    `_pulls` (jobs by transfer id) and `_results` (finished pulls), sets `job_type`, and hands a
    started pull to its control thread in `_command_pull(key)`."""

    job_type: type[PullJob] = PullJob

    def start_pull(
        self, remote: RemoteBlocks, local_block_ids: list[int], timeout_s: float
    ) -> None:
        job = new_pull_job(self.job_type, self.kv, remote, local_block_ids, timeout_s)
        with self._lock:
            self._pulls[remote.key] = job
        self._command_pull(remote.key)

    def completed(self) -> list[PullResult]:
        with self._lock:
            out = list(self._results)
            self._results.clear()
        return out


def report_pull(job: PullJob, pulls: dict, results: deque) -> bool:
    """Under the lock: a pull nothing writes into any more leaves `pulls`, and its result
    (bytes moved, or its error) is queued unless it was cancelled quietly. True: one was."""
    job.reported = True
    key = job.remote.key
    if pulls.get(key) is job:
        del pulls[key]
    if job.quiet:
        return False
    nbytes = 0 if job.error else job.kv.num_units(len(job.local_ids)) * job.kv.unit_bytes
    results.append(PullResult(key, job.error, nbytes))
    return True


def open_dealer(
    ctx: zmq.Context, poller: zmq.Poller, host: str, port: int, max_bytes: int
) -> zmq.Socket:
    """A DEALER connected to a producer's control port (an IPv6 literal bracketed) and polled;
    ZMQ drops an answer larger than max_bytes."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    h = f"[{host}]" if ":" in host else host
    sock.connect(f"tcp://{h}:{port}")
    poller.register(sock, zmq.POLLIN)
    return sock


def waiting_messages(sock: zmq.Socket, wire) -> Iterator[object]:
    """The messages waiting on a socket (a DEALER's answers, the control thread's commands),
    decoded with `wire` (a msgspec decoder), without blocking; what does not decode is dropped."""
    while True:
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return
        try:
            msg = wire.decode(frames[0].buffer)
        except ValueError:  # msgspec.DecodeError is one
            continue
        yield msg

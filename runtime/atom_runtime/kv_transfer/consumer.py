"""The consumer's side of the portable transport: pull held blocks from the producer the router
named, stripe by stripe, straight into the local blocks.

A pull is a sealed `Pull` to the producer's control port (one DEALER per producer address), then
one TCP connection per stripe of the granted ticket: each sends a sealed `Stripe(ticket, index)`
and reads exactly that stripe's bytes into the cache (CPU: the sockets write the blocks
themselves; GPU: through two pinned chunks per worker, copied to the device on a side stream).
A reply that is not sealed with the deployment's key, or answers another pull, fails the pull.
A stripe closed early fails the whole pull (its siblings are stopped at once); a pull not done
within its timeout fails too, and the engine then prefills locally.

`ConsumerSide` is a part of `TCPConnector` (tcp.py), kept apart so each side reads on its own;
it uses the connector's lock, key seal, pools and command socket.
"""

from __future__ import annotations

import logging
import socket
import time
from collections import deque
from dataclasses import dataclass, field

import zmq

from atom_runtime.kv_transfer.base import PullResult, plan_stripes
from atom_runtime.kv_transfer.config import MAX_STREAMS
from atom_runtime.kv_transfer.payload import (
    chunks,
    frame,
    recv_exact,
    recv_views,
    shutdown,
    size_buffers,
)
from atom_runtime.kv_transfer.pulls import PullBook, PullJob, report_pull, waiting_messages
from atom_runtime.kv_transfer.wire import PROTOCOL, Pull, PullReply, Release, Stripe

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _PullJob(PullJob):
    """A pull over the portable transport: its ticket, stripes and the tasks moving them."""

    stripes: list[tuple[int, int]] = field(default_factory=list)
    data_port: int = 0
    ticket: str = ""
    granted: bool = False  # the producer answered with a ticket: stripes are queued or moving
    active: int = 0  # stripe tasks touching the local blocks now
    unsettled: int = 0  # stripe tasks not finished
    socks: set = field(default_factory=set)


class ConsumerSide(PullBook):
    job_type = _PullJob

    def _init_consumer(self) -> None:
        self._pulls: dict[str, _PullJob] = {}
        self._results: deque[PullResult] = deque()

    # -- engine thread ---------------------------------------------------------------------------

    def cancel_pull(self, transfer_id: str) -> bool:
        with self._lock:
            job = self._pulls.get(transfer_id)
            if job is None:
                return True
            job.quiet = True
            self._fail(job, "cancelled")  # settles at once unless a stripe is moving
            job.quiet = False  # a stripe is moving: its end reports the pull
            return job.reported

    def release_remote(self, host: str, port: int, transfer_id: str) -> None:
        self._command_release(host, port, transfer_id)

    # -- control thread --------------------------------------------------------------------------

    def _send_pull(self, sock: zmq.Socket, key: str) -> None:
        """Send the Pull of a started job (unless it was cancelled meanwhile)."""
        with self._lock:
            job = self._pulls.get(key)
            if job is None:
                return
            r = job.remote
            remaining = max(0.001, job.deadline - time.monotonic())
            msg = Pull(
                r.transfer_id,
                r.block_ids,
                self.kv.layout,
                PROTOCOL,
                self.streams,
                remaining,
                heads=r.heads,
            )
            self.seal.seal(msg)
            job.nonce = msg.nonce
        try:
            sock.send(self._encoder.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            with self._lock:
                self._fail(job, "the producer is unreachable")

    def _send_release(self, sock: zmq.Socket, transfer_id: str) -> None:
        try:
            sock.send(self._encoder.encode(self.seal.seal(Release(transfer_id))), zmq.NOBLOCK)
        except zmq.Again:
            pass  # the producer is gone; its hold times out on its side

    def _on_reply(self, sock: zmq.Socket) -> None:
        for reply in waiting_messages(sock, self._wire):
            if not isinstance(reply, PullReply):
                continue
            error = self.seal.check(reply)
            with self._lock:
                job = self._job_for(reply)
                if job is None or job.granted or job.error is not None:
                    continue  # cancelled or timed out already: drop the late answer
                if error is None and reply.nonce != job.nonce and self.seal.key is not None:
                    error = "the producer answered another pull"
                if error is not None:
                    self._fail(job, f"the producer's answer: {error}")
                else:
                    self._take_reply(job, reply)

    def _job_for(self, reply: PullReply) -> _PullJob | None:
        """Under the lock: the pull a reply answers. One transfer may be read from several
        producer ranks at once (several pulls): the one whose nonce the reply echoes."""
        jobs = [j for j in self._pulls.values() if j.remote.transfer_id == reply.transfer_id]
        return next((j for j in jobs if j.nonce == reply.nonce), jobs[0] if jobs else None)

    def _take_reply(self, job: _PullJob, reply: PullReply) -> None:
        """Under the lock: fail the pull, or queue its stripes."""
        nbytes = job.kv.num_units(len(job.local_ids)) * job.kv.unit_bytes
        if reply.error is not None:
            self._fail(job, reply.error)
        elif reply.data_port == 0:
            self._fail(
                job,
                f"the producer speaks KV transfer protocol 1, this consumer {PROTOCOL}: run "
                "the same ATOM version on prefill and decode engines",
            )
        elif reply.nbytes != nbytes or not 1 <= reply.stripes <= MAX_STREAMS:
            self._fail(job, f"the producer offers {reply.nbytes} bytes, {nbytes} expected")
        else:
            job.granted = True
            job.data_port, job.ticket = reply.data_port, reply.ticket
            job.stripes = plan_stripes(job.kv.num_units(len(job.local_ids)), reply.stripes)
            job.unsettled = len(job.stripes)
            for index in range(len(job.stripes)):
                self._receivers.submit(self._receive_stripe, job, index)

    def _expire_consumer(self, now: float) -> None:
        with self._lock:
            for job in [j for j in self._pulls.values() if j.deadline <= now]:
                what = "the payload" if job.granted else "the producer's answer"
                self._fail(job, f"{what} did not arrive in time")

    def _fail(self, job: _PullJob, error: str) -> None:
        """Under the lock: the pull fails (first error wins); its stripes stop."""
        if job.error is None:
            job.error = error
        for sock in job.socks:
            shutdown(sock)
        self._settle_pull(job)

    def _settle_pull(self, job: _PullJob) -> None:
        """Under the lock: report a pull that is done, or failed with no stripe touching its
        blocks any more. A pull cancelled before that is reported once its stripes stopped."""
        if job.reported:
            return
        if job.error is None and job.unsettled:
            return
        if job.error is not None and job.active:
            return
        if report_pull(job, self._pulls, self._results):
            self._wake.set()

    # -- receiver threads ------------------------------------------------------------------------

    def _receive_stripe(self, job: _PullJob, index: int) -> None:
        with self._lock:
            if job.error is not None:  # failed, cancelled or timed out while queued
                job.unsettled -= 1
                self._settle_pull(job)
                return
            job.active += 1
        sock = None
        error = None
        try:
            sock = self._connect(job)
            hello = self.seal.seal(Stripe(job.ticket, index))
            sock.sendall(frame(self._encoder.encode(hello)))
            start, end = job.stripes[index]
            self._receive_units(sock, job, start, end)
        except (OSError, ValueError) as e:
            error = f"payload stripe {index}: {e}"
        except Exception as e:
            log.exception("receiving a KV stripe")
            error = f"payload stripe {index}: {e!r}"
        finally:
            with self._lock:
                if sock is not None:
                    job.socks.discard(sock)
                    sock.close()
                job.active -= 1
                job.unsettled -= 1
                if error is not None:
                    self._fail(job, error)
                else:
                    self._settle_pull(job)

    def _connect(self, job: _PullJob) -> socket.socket:
        remaining = job.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the pull timed out before this stripe started")
        host, port = job.remote.host, job.data_port
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        with self._lock:
            if job.error is not None:
                sock.close()
                raise ConnectionAbortedError(job.error)
            job.socks.add(sock)  # from here a failure elsewhere shuts it down
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        size_buffers(sock, self.config.socket_buffer_bytes)  # before connect: window scaling
        sock.settimeout(remaining)
        sock.connect(address)
        sock.settimeout(None)  # the pull's deadline shuts it down
        return sock

    def _receive_units(self, sock: socket.socket, job: _PullJob, start: int, end: int) -> None:
        kv = job.kv
        if kv.direct:
            recv_views(sock, kv.views(job.local_ids, start, end))
            return
        index = kv.block_index(job.local_ids)
        # The pair's exit waits for the last scatters: the bytes are in the cache before the pull
        # reports.
        with self.staging.pair() as (bufs, done):  # each buffer's scatter event
            for k, (a, b) in enumerate(chunks(start, end, self._chunk_units)):
                i = k % 2
                if done[i] is not None:
                    done[i].synchronize()  # its last chunk has left for the device
                    done[i] = None
                recv_exact(sock, bufs[i][1][: (b - a) * kv.unit_bytes])
                done[i] = kv.scatter(index, a, b, bufs[i][0], job.fence)

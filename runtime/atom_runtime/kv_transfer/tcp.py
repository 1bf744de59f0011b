"""The portable KV transport: ZMQ for control, plain TCP for the payload, no pickle.

Control (ZMQ over TCP, msgspec msgpack headers): the producer's ROUTER socket on kv_ip:kv_port
answers `Pull(transfer_id, block_ids, layout, version, streams, timeout_s)` with a `PullReply`
that names an error or grants a ticket (payload port, ticket id, stripe count, byte count), and
records `Release(transfer_id)`. A consumer keeps one DEALER per producer address; a pull that is
not done within its timeout fails (the engine then prefills locally).

Payload (plain TCP, protocol 2): the payload in KVCacheAccess's wire layout is cut into contiguous
stripes of whole units (`plan_stripes`). The consumer opens one connection per stripe to the
producer's data port, sends `Stripe(ticket, index)` (a 4-byte big-endian length, then msgpack) and
reads exactly that stripe's bytes; nothing else travels on a payload connection. A connection
closed early fails the whole pull (its sibling stripes are stopped at once).

Threads: one control thread owns every ZMQ socket and the data listener. Stripes move on
`streams` worker threads per role, in arrival order: a queued pull waits for the one ahead of it
rather than sharing its bandwidth. A contiguous CPU cache is read and written by the sockets
themselves (sendmsg / recvmsg_into over the blocks' memory, no copy); a GPU cache moves through
two reusable pinned chunks per stripe worker, with the device copies on KVCacheAccess's side stream, so
one chunk crosses PCIe while the next crosses the network. A pull appears in `completed()` only
once its bytes are in the cache, so the engine thread never waits on a transfer.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import msgspec
import torch
import zmq

from atom_runtime.kv_transfer.base import (
    KVCacheAccess,
    KVConnector,
    PullResult,
    RemoteBlocks,
    plan_stripes,
)
from atom_runtime.kv_transfer.config import MAX_STREAMS, KVTransferConfig

log = logging.getLogger(__name__)

PROTOCOL = 2  # 1: the payload was a second ZMQ frame of the PullReply
CHUNK_BYTES = 8 << 20  # a staged stripe moves in chunks of about this size
HELLO_TIMEOUT_S = 10.0  # a payload connection must name its stripe within this
IOV_BATCH = 512  # views per sendmsg/recvmsg_into call (Linux allows 1024)
# Payload sockets block (no Python timeout) and receive with MSG_WAITALL, so one system call
# moves a whole chunk or view batch without returning to Python: a busy engine thread holding the
# GIL then costs one switch per chunk, not one per socket-buffer refill. Deadlines are enforced by
# the control thread, which shuts a late stripe's sockets down (that wakes the blocked call).
_WAITALL = getattr(socket, "MSG_WAITALL", 0)


class Pull(msgspec.Struct, tag=True):
    transfer_id: str
    block_ids: list[int]
    layout: str
    version: int = 1  # a protocol-1 consumer sends no version
    streams: int = 1
    timeout_s: float = 30.0  # how long the consumer will wait: the ticket's lifetime


class PullReply(msgspec.Struct, tag=True):
    transfer_id: str
    error: str | None = None  # None: the payload waits on data_port under `ticket`
    data_port: int = 0  # 0 from a protocol-1 producer, whose payload frame follows instead
    ticket: str = ""
    stripes: int = 0
    nbytes: int = 0


class Release(msgspec.Struct, tag=True):
    transfer_id: str


class Stripe(msgspec.Struct, tag=True):
    """The first (and only) message on a payload connection: which stripe it carries."""

    ticket: str
    index: int


class _StartPull(msgspec.Struct, tag=True):
    transfer_id: str


class _ReleaseRemote(msgspec.Struct, tag=True):
    host: str
    port: int
    transfer_id: str


class _Stop(msgspec.Struct, tag=True):
    pass


_WIRE = Pull | PullReply | Release
_COMMANDS = _StartPull | _ReleaseRemote | _Stop


@dataclass(eq=False)
class _PullJob:
    """Consumer: one pull, from start_pull until it is reported (under the connector's lock)."""

    remote: RemoteBlocks
    local_ids: list[int]
    deadline: float
    fence: object  # CUDA event the side-stream writes wait for, or None
    stripes: list[tuple[int, int]] = field(default_factory=list)
    data_port: int = 0
    ticket: str = ""
    granted: bool = False  # the producer answered with a ticket: stripes are queued or moving
    error: str | None = None
    quiet: bool = False  # cancelled with nothing in flight: cancel_pull said so, no result
    active: int = 0  # stripe tasks touching the local blocks now
    unsettled: int = 0  # stripe tasks not finished
    reported: bool = False
    socks: set = field(default_factory=set)


@dataclass(eq=False)
class _Ticket:
    """Producer: one granted pull, until every stripe is sent, or it fails or expires."""

    ticket: str
    transfer_id: str
    block_ids: list[int]
    stripes: list[tuple[int, int]]
    deadline: float
    fence: object
    claimed: set = field(default_factory=set)
    active: int = 0
    sent: int = 0
    failed: bool = False
    socks: set = field(default_factory=set)


class StagingPool:
    """Reusable host buffers (pinned for a GPU cache) for staged stripes: at most `capacity`
    are ever allocated, created on first use; `acquire` waits while all are out."""

    def __init__(self, capacity: int, nbytes: int, pin: bool) -> None:
        self.capacity, self.nbytes, self.pin = capacity, nbytes, pin
        self._free: list[tuple[torch.Tensor, memoryview]] = []
        self.allocated = 0
        self._cond = threading.Condition()

    def acquire(self) -> tuple[torch.Tensor, memoryview]:
        with self._cond:
            while not self._free and self.allocated >= self.capacity:
                self._cond.wait()
            if self._free:
                return self._free.pop()
            self.allocated += 1
        buf = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=self.pin)
        return buf, memoryview(buf.numpy())

    def release(self, buf: tuple[torch.Tensor, memoryview]) -> None:
        with self._cond:
            self._free.append(buf)
            self._cond.notify()


class TCPConnector(KVConnector):
    def __init__(
        self, config: KVTransferConfig, kv: KVCacheAccess, chunk_bytes: int = CHUNK_BYTES
    ) -> None:
        self.config = config
        self.kv = kv
        self.engine_id = uuid.uuid4().hex
        self.streams = config.streams
        self._chunk_units = max(1, chunk_bytes // kv.unit_bytes)
        self._ctx = zmq.Context()
        self._encoder = msgspec.msgpack.Encoder()
        self._wire = msgspec.msgpack.Decoder(_WIRE)
        self._commands = msgspec.msgpack.Decoder(_COMMANDS)
        self._stripe_decoder = msgspec.msgpack.Decoder(Stripe)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        # Producer state, shared with the threads under the lock.
        self._offers: dict[str, tuple[set[int], object]] = {}  # transfer id -> (blocks, fence)
        self._reading: dict[str, int] = {}
        self._released: list[str] = []
        self._tickets: dict[str, _Ticket] = {}
        self._conns: set[socket.socket] = set()  # accepted payload connections
        # Consumer state.
        self._pulls: dict[str, _PullJob] = {}
        self._results: deque[PullResult] = deque()
        self.blocks_sent = 0
        self.bytes_sent = 0

        workers = self.streams * (int(config.is_producer) + int(config.is_consumer))
        self.staging = StagingPool(
            2 * workers, self._chunk_units * kv.unit_bytes, pin=kv.pin
        )  # two chunks per stripe worker: one on the wire, one being copied
        self._router: zmq.Socket | None = None
        self._listener: socket.socket | None = None
        self._senders: ThreadPoolExecutor | None = None
        self._receivers: ThreadPoolExecutor | None = None
        self._port = config.kv_port
        self._data_port = 0
        if config.is_producer:
            self._router, self._listener = self._listen()
            self._data_port = self._listener.getsockname()[1]
            self._senders = ThreadPoolExecutor(self.streams, "kv-stripe-send")
        if config.is_consumer:
            self._receivers = ThreadPoolExecutor(self.streams, "kv-stripe-recv")
        inproc = f"inproc://kv-transfer-{self.engine_id}"
        self._cmd_pull = self._ctx.socket(zmq.PULL)
        self._cmd_pull.bind(inproc)
        self._cmd_push = self._ctx.socket(zmq.PUSH)  # the engine thread's end
        self._cmd_push.connect(inproc)
        self._advertised = config.advertise_host()
        self._thread = threading.Thread(target=self._run, name="kv-transfer", daemon=True)
        self._thread.start()

    def _listen(self) -> tuple[zmq.Socket, socket.socket]:
        config = self.config
        wildcard = config.kv_ip in ("0.0.0.0", "::", "*")
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        host = "*" if wildcard else config.kv_ip
        try:
            router.bind(f"tcp://{host}:{config.kv_port}")
        except zmq.ZMQError as e:
            router.close()
            self._ctx.term()
            raise ValueError(
                f"kv_transfer_config.kv_port: cannot listen on {host}:{config.kv_port} ({e})"
            ) from None
        ip = "::" if config.kv_ip == "::" else "0.0.0.0" if wildcard else config.kv_ip
        listener = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            _size_buffers(listener, config.socket_buffer_bytes)  # accepted sockets inherit them
            listener.bind((ip, config.data_port))
            listener.listen(128)
            listener.setblocking(False)
        except OSError as e:
            listener.close()
            router.close()
            self._ctx.term()
            raise ValueError(
                "kv_transfer_config.kv_connector_extra_config.data_port: cannot listen on "
                f"{ip}:{config.data_port} ({e})"
            ) from None
        return router, listener

    # -- engine thread: producer -----------------------------------------------------------------

    def address(self) -> tuple[str, int]:
        return self._advertised, self._port

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

    # -- engine thread: consumer -----------------------------------------------------------------

    def start_pull(
        self, remote: RemoteBlocks, local_block_ids: list[int], timeout_s: float
    ) -> None:
        if len(local_block_ids) != len(remote.block_ids) or not local_block_ids:
            raise ValueError(
                f"start_pull: {len(remote.block_ids)} remote blocks into "
                f"{len(local_block_ids)} local ones"
            )
        job = _PullJob(remote, list(local_block_ids), time.monotonic() + timeout_s, self.kv.fence())
        with self._lock:
            self._pulls[remote.transfer_id] = job
        self._command(_StartPull(remote.transfer_id))

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
        self._command(_ReleaseRemote(host, port, transfer_id))

    def completed(self) -> list[PullResult]:
        with self._lock:
            out = list(self._results)
            self._results.clear()
        return out

    def wait(self, timeout_s: float) -> None:
        self._wake.wait(timeout_s)
        self._wake.clear()

    def close(self) -> None:
        if self._thread.is_alive():
            self._command(_Stop())
            self._thread.join(5)
        self._cmd_push.close(linger=0)
        with self._lock:
            self._closed = True
            for job in list(self._pulls.values()):
                self._fail(job, "the connector closed")
            for ticket in list(self._tickets.values()):
                self._fail_ticket(ticket)
            for conn in self._conns:
                _shutdown(conn)
        for pool in (self._senders, self._receivers):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            for conn in self._conns:  # accepted, never served: their tasks were cancelled
                conn.close()
            self._conns.clear()
        if self._thread.is_alive():
            log.warning("KV transfer thread did not stop; leaving its sockets to the process")
            return
        self._ctx.term()

    def _command(self, msg: msgspec.Struct) -> None:
        self._cmd_push.send(self._encoder.encode(msg))

    # -- the control thread ----------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._cmd_pull, zmq.POLLIN)
        if self._router is not None:
            poller.register(self._router, zmq.POLLIN)
            poller.register(self._listener, zmq.POLLIN)
        listen_fd = self._listener.fileno() if self._listener is not None else None
        dealers: dict[tuple[str, int], zmq.Socket] = {}
        try:
            while True:
                for sock, _ in poller.poll(50):
                    if sock is self._cmd_pull:
                        if not self._on_commands(poller, dealers):
                            return
                    elif sock is self._router:
                        self._serve(sock)
                    elif sock == listen_fd:  # a plain socket: the poller hands back its fd
                        self._accept()
                    else:
                        self._on_reply(sock)
                self._expire(time.monotonic())
        except Exception:
            log.exception("KV transfer thread failed")
            with self._lock:  # nothing expires without this thread: end everything now
                for job in list(self._pulls.values()):
                    self._fail(job, "the KV transfer thread failed")
                for ticket in list(self._tickets.values()):
                    self._fail_ticket(ticket)
        finally:
            for sock in [self._cmd_pull, *dealers.values()]:
                sock.close(linger=0)
            if self._router is not None:
                self._router.close(linger=0)
                self._listener.close()

    def _expire(self, now: float) -> None:
        with self._lock:
            for job in [j for j in self._pulls.values() if j.deadline <= now]:
                what = "the payload" if job.granted else "the producer's answer"
                self._fail(job, f"{what} did not arrive in time")
            for ticket in [t for t in self._tickets.values() if t.deadline <= now]:
                self._fail_ticket(ticket)

    def _dealer(self, poller, dealers, host: str, port: int) -> zmq.Socket:
        sock = dealers.get((host, port))
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            h = f"[{host}]" if ":" in host else host
            sock.connect(f"tcp://{h}:{port}")
            poller.register(sock, zmq.POLLIN)
            dealers[(host, port)] = sock
        return sock

    def _on_commands(self, poller, dealers) -> bool:
        while True:
            try:
                raw = self._cmd_pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True
            cmd = self._commands.decode(raw)
            if isinstance(cmd, _Stop):
                return False
            if isinstance(cmd, _StartPull):
                with self._lock:
                    job = self._pulls.get(cmd.transfer_id)
                if job is None:
                    continue  # cancelled before it was sent
                r = job.remote
                sock = self._dealer(poller, dealers, r.host, r.port)
                remaining = max(0.0, job.deadline - time.monotonic())
                msg = Pull(
                    r.transfer_id, r.block_ids, self.kv.layout, PROTOCOL, self.streams, remaining
                )
                try:
                    sock.send(self._encoder.encode(msg), zmq.NOBLOCK)
                except zmq.Again:
                    with self._lock:
                        self._fail(job, "the producer is unreachable")
            elif isinstance(cmd, _ReleaseRemote):
                sock = self._dealer(poller, dealers, cmd.host, cmd.port)
                try:
                    sock.send(self._encoder.encode(Release(cmd.transfer_id)), zmq.NOBLOCK)
                except zmq.Again:
                    pass  # the producer is gone; its hold times out on its side

    # -- producer: control -----------------------------------------------------------------------

    def _serve(self, router: zmq.Socket) -> None:
        while True:
            try:
                ident, raw = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except ValueError:
                continue  # not [identity, header]: not ours
            try:
                msg = self._wire.decode(raw)
            except msgspec.DecodeError:
                log.warning("ignoring an undecodable KV transfer message")
                continue
            if isinstance(msg, Release):
                with self._lock:
                    self._released.append(msg.transfer_id)
                self._wake.set()
            elif isinstance(msg, Pull):
                reply = self._grant(msg)
                router.send_multipart([ident, self._encoder.encode(reply)])

    def _grant(self, msg: Pull) -> PullReply:
        """Check a pull and register its ticket (the blocks count as being read from now on)."""
        tid = msg.transfer_id
        if msg.version != PROTOCOL:
            return PullReply(
                tid,
                f"the consumer speaks KV transfer protocol {msg.version}, this producer "
                f"{PROTOCOL}: run the same ATOM version on prefill and decode engines",
            )
        if msg.layout != self.kv.layout:
            return PullReply(
                tid, f"KV layout {msg.layout} does not match this engine's {self.kv.layout}"
            )
        with self._lock:
            offer = self._offers.get(tid)
            if offer is None:
                return PullReply(tid, f"transfer {tid} is unknown here (released or timed out)")
            offered, fence = offer
            if not msg.block_ids or not set(msg.block_ids) <= offered:
                missing = sorted(set(msg.block_ids) - offered)
                return PullReply(tid, f"transfer {tid}: blocks {missing} not held")
            units = self.kv.num_units(len(msg.block_ids))
            stripes = plan_stripes(units, max(1, min(msg.streams, self.streams)))
            ticket = _Ticket(
                uuid.uuid4().hex,
                tid,
                list(msg.block_ids),
                stripes,
                time.monotonic() + min(max(msg.timeout_s, 0.0), 3600.0) + 1.0,
                fence,
            )
            self._tickets[ticket.ticket] = ticket
            self._reading[tid] = self._reading.get(tid, 0) + 1
        return PullReply(
            tid,
            data_port=self._data_port,
            ticket=ticket.ticket,
            stripes=len(stripes),
            nbytes=units * self.kv.unit_bytes,
        )

    def _fail_ticket(self, ticket: _Ticket) -> None:
        """Under the lock: stop a ticket's stripes; it ends once none is being sent."""
        ticket.failed = True
        for conn in ticket.socks:
            _shutdown(conn)
        self._settle_ticket(ticket)

    def _settle_ticket(self, ticket: _Ticket) -> None:
        """Under the lock: end a ticket that is fully sent, or failed with no stripe moving."""
        if self._tickets.get(ticket.ticket) is not ticket:
            return
        done = ticket.sent == len(ticket.stripes)
        if not done and not (ticket.failed and ticket.active == 0):
            return
        del self._tickets[ticket.ticket]
        tid = ticket.transfer_id
        self._reading[tid] -= 1
        if not self._reading[tid]:
            del self._reading[tid]
        if done:
            self.blocks_sent += len(ticket.block_ids)
            self.bytes_sent += self.kv.num_units(len(ticket.block_ids)) * self.kv.unit_bytes

    # -- producer: payload -----------------------------------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                log.warning("accepting a KV payload connection: %s", e)
                return
            conn.setblocking(True)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.add(conn)
            self._senders.submit(self._send_stripe, conn)

    def _send_stripe(self, conn: socket.socket) -> None:
        ticket = None
        ok = False
        try:
            conn.settimeout(HELLO_TIMEOUT_S)
            hello = self._stripe_decoder.decode(_recv_frame(conn))
            with self._lock:
                ticket = self._tickets.get(hello.ticket)
                if (
                    ticket is None
                    or ticket.failed
                    or self._closed
                    or not 0 <= hello.index < len(ticket.stripes)
                    or hello.index in ticket.claimed
                ):
                    ticket = None
                    return  # unknown, expired or duplicate: closing the connection says so
                ticket.claimed.add(hello.index)
                ticket.active += 1
                ticket.socks.add(conn)
            conn.settimeout(None)  # the ticket's expiry shuts it down
            start, end = ticket.stripes[hello.index]
            self._send_units(conn, ticket, start, end)
            ok = True
        except (OSError, ValueError, msgspec.DecodeError) as e:
            log.info("KV stripe not sent: %s", e)
        except Exception:
            log.exception("sending a KV stripe")
        finally:
            with self._lock:
                self._conns.discard(conn)
                if ticket is not None:
                    ticket.socks.discard(conn)
                    ticket.active -= 1
                    if ok:
                        ticket.sent += 1
                        self._settle_ticket(ticket)
                    else:
                        self._fail_ticket(ticket)  # the consumer fails the pull anyway
                conn.close()

    def _send_units(self, conn: socket.socket, ticket: _Ticket, start: int, end: int) -> None:
        kv = self.kv
        if kv.direct:
            _send_views(conn, kv.views(ticket.block_ids, start, end))
            return
        chunks = _chunks(start, end, self._chunk_units)
        index = kv.block_index(ticket.block_ids)
        bufs = [self.staging.acquire(), self.staging.acquire()]
        done: list = [None, None]  # each buffer's gather event
        try:
            a, b = chunks[0]
            done[0] = kv.gather(index, a, b, bufs[0][0], ticket.fence)
            for k, (a, b) in enumerate(chunks):
                if k + 1 < len(chunks):  # the next chunk's copy overlaps this one's send
                    na, nb = chunks[k + 1]
                    nxt = (k + 1) % 2
                    done[nxt] = kv.gather(index, na, nb, bufs[nxt][0], ticket.fence)
                i = k % 2
                if done[i] is not None:
                    done[i].synchronize()
                    done[i] = None
                conn.sendall(bufs[i][1][: (b - a) * kv.unit_bytes])
        finally:
            for event in done:
                if event is not None:
                    event.synchronize()  # a copy still writing into a buffer we give back
            for buf in bufs:
                self.staging.release(buf)

    # -- consumer --------------------------------------------------------------------------------

    def _on_reply(self, sock: zmq.Socket) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                reply = self._wire.decode(frames[0].buffer)
            except msgspec.DecodeError:
                continue
            if not isinstance(reply, PullReply):
                continue
            with self._lock:
                job = self._pulls.get(reply.transfer_id)
                if job is None or job.granted or job.error is not None:
                    continue  # cancelled or timed out already: drop the late answer
                self._take_reply(job, reply)

    def _take_reply(self, job: _PullJob, reply: PullReply) -> None:
        """Under the lock: fail the pull, or queue its stripes."""
        nbytes = self.kv.num_units(len(job.local_ids)) * self.kv.unit_bytes
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
            job.stripes = plan_stripes(self.kv.num_units(len(job.local_ids)), reply.stripes)
            job.unsettled = len(job.stripes)
            for index in range(len(job.stripes)):
                self._receivers.submit(self._receive_stripe, job, index)

    def _fail(self, job: _PullJob, error: str) -> None:
        """Under the lock: the pull fails (first error wins); its stripes stop."""
        if job.error is None:
            job.error = error
        for sock in job.socks:
            _shutdown(sock)
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
        job.reported = True
        tid = job.remote.transfer_id
        if self._pulls.get(tid) is job:
            del self._pulls[tid]
        if job.quiet:
            return
        nbytes = 0 if job.error else self.kv.num_units(len(job.local_ids)) * self.kv.unit_bytes
        self._results.append(PullResult(job.remote.transfer_id, job.error, nbytes))
        self._wake.set()

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
            sock.sendall(_frame(self._encoder.encode(Stripe(job.ticket, index))))
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
        _size_buffers(sock, self.config.socket_buffer_bytes)  # before connect: window scaling
        sock.settimeout(remaining)
        sock.connect(address)
        sock.settimeout(None)  # the pull's deadline shuts it down
        return sock

    def _receive_units(self, sock: socket.socket, job: _PullJob, start: int, end: int) -> None:
        kv = self.kv
        if kv.direct:
            _recv_views(sock, kv.views(job.local_ids, start, end))
            return
        index = kv.block_index(job.local_ids)
        bufs = [self.staging.acquire(), self.staging.acquire()]
        done: list = [None, None]  # each buffer's scatter event
        try:
            for k, (a, b) in enumerate(_chunks(start, end, self._chunk_units)):
                i = k % 2
                if done[i] is not None:
                    done[i].synchronize()  # its last chunk has left for the device
                    done[i] = None
                _recv_exact(sock, bufs[i][1][: (b - a) * kv.unit_bytes])
                done[i] = kv.scatter(index, a, b, bufs[i][0], job.fence)
        finally:
            for event in done:
                if event is not None:
                    event.synchronize()  # the bytes are in the cache before the pull reports
            for buf in bufs:
                self.staging.release(buf)


# -- sockets --------------------------------------------------------------------------------------


def _chunks(start: int, end: int, size: int) -> list[tuple[int, int]]:
    return [(a, min(a + size, end)) for a in range(start, end, size)]


def _size_buffers(sock: socket.socket, nbytes: int) -> None:
    if nbytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, nbytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, nbytes)


def _shutdown(sock: socket.socket) -> None:
    """Wake a thread blocked on `sock` (the owner closes it); call under the owner's lock."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # not connected yet, or already closed


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def _recv_frame(sock: socket.socket) -> bytes:
    head = bytearray(4)
    _recv_exact(sock, memoryview(head))
    (size,) = struct.unpack(">I", head)
    if size > 4096:
        raise ValueError(f"a {size}-byte stripe header")
    body = bytearray(size)
    _recv_exact(sock, memoryview(body))
    return bytes(body)


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:], 0, _WAITALL)
        if n == 0:
            raise ConnectionError(f"closed by the peer after {got} of {len(view)} bytes")
        got += n


def _advance(views: list[memoryview], i: int, n: int) -> int:
    """Skip n bytes from views[i]; returns the first view not yet done (trimming it in place)."""
    while n:
        if n >= len(views[i]):
            n -= len(views[i])
            i += 1
        else:
            views[i] = views[i][n:]
            n = 0
    return i


def _send_views(sock: socket.socket, views: list[memoryview]) -> None:
    i = 0
    while i < len(views):
        i = _advance(views, i, sock.sendmsg(views[i : i + IOV_BATCH]))


def _recv_views(sock: socket.socket, views: list[memoryview]) -> None:
    total, i = sum(len(v) for v in views), 0
    got = 0
    while i < len(views):
        n = sock.recvmsg_into(views[i : i + IOV_BATCH], 0, _WAITALL)[0]
        if n == 0:
            raise ConnectionError(f"closed by the peer after {got} of {total} bytes")
        got += n
        i = _advance(views, i, n)

"""The producer's side of the portable transport: answer pulls of held blocks, send their stripes.

Control: each `Pull` is checked (protocol version, the transfer key's seal, a finite timeout of
at most MAX_PULL_TIMEOUT_S, the KV layout, block ids that are unique and all in the hold, at most
MAX_TICKETS_PER_PEER pulls at once from one address) before it is granted a ticket: a random
128-bit id, good for one pull's stripes until the pull's timeout. Garbage on the control port is
dropped (ZMQ's MAXMSGSIZE disconnects a peer that sends more than a pull can hold) and logged at
most once per LOG_INTERVAL_S.

Payload: an accepted connection takes no sender thread until it presents a sealed `Stripe`
naming a live ticket and an unclaimed stripe; until then the control thread reads it without
blocking, and drops it after HELLO_TIMEOUT_S. One address keeps at most MAX_CONNS_PER_PEER
payload connections open, and at most MAX_PENDING_HELLOS wait for their hello in all.

`ProducerSide` is a part of `TCPConnector` (tcp.py), kept apart so each side reads on its own;
it uses the connector's lock, poller, key seal, pools and counters.
"""

from __future__ import annotations

import logging
import secrets
import socket
import time
from collections import Counter
from dataclasses import dataclass, field

import msgspec
import zmq

from atom_runtime.kv_transfer.base import KVCacheAccess, plan_stripes
from atom_runtime.kv_transfer.config import MAX_STREAMS
from atom_runtime.kv_transfer.holds import MAX_TICKETS_PER_PEER, OfferBook, refused_pull
from atom_runtime.kv_transfer.payload import (
    PendingHello,
    chunks,
    send_views,
    shutdown,
)
from atom_runtime.kv_transfer.wire import PROTOCOL, Pull, PullReply, Stripe

log = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 2.0  # a payload connection must name its stripe within this
MAX_CONNS_PER_PEER = MAX_STREAMS  # a consumer opens at most `streams` stripes at once
MAX_PENDING_HELLOS = 256
LOG_INTERVAL_S = 10.0


@dataclass(eq=False)
class _Ticket:
    """One granted pull, until every stripe is sent, or it fails or expires."""

    ticket: str
    transfer_id: str
    block_ids: list[int]
    stripes: list[tuple[int, int]]
    deadline: float
    fence: object
    peer: str
    kv: KVCacheAccess  # the cache seen through the heads this pull reads
    claimed: set = field(default_factory=set)
    active: int = 0
    sent: int = 0
    failed: bool = False
    socks: set = field(default_factory=set)


class ProducerSide(OfferBook):
    def _init_producer(self) -> None:
        self._init_offers()
        self._tickets: dict[str, _Ticket] = {}
        self._conns: set[socket.socket] = set()  # accepted payload connections
        self._peer_conns: Counter[str] = Counter()
        self._hellos: dict[int, PendingHello] = {}  # fd -> a connection yet to name its stripe
        self._stripe_decoder = msgspec.msgpack.Decoder(Stripe)
        self.blocks_sent = 0
        self.bytes_sent = 0

    # -- engine thread ---------------------------------------------------------------------------

    def address(self) -> tuple[str, int]:
        return self._advertised, self._port

    # -- control thread: control -----------------------------------------------------------------

    def _grant(self, msg: Pull, peer: str) -> PullReply:
        """Check a pull and register its ticket (the blocks count as being read from now on)."""
        tid = msg.transfer_id
        error = refused_pull(msg, self.seal, self.kv, PROTOCOL, "KV transfer")
        if error is not None:
            return PullReply(tid, error)
        with self._lock:
            error, fence = self._grant_error(tid, msg.block_ids)
            if error is not None:
                return PullReply(tid, error)
            if sum(t.peer == peer for t in self._tickets.values()) >= MAX_TICKETS_PER_PEER:
                return PullReply(tid, f"more than {MAX_TICKETS_PER_PEER} pulls at once")
            kv = self.kv.restrict(msg.heads)
            units = kv.num_units(len(msg.block_ids))
            stripes = plan_stripes(units, max(1, min(msg.streams, self.streams)))
            deadline = time.monotonic() + msg.timeout_s + 1.0
            ticket = _Ticket(
                secrets.token_hex(16), tid, list(msg.block_ids), stripes, deadline, fence, peer, kv
            )
            self._tickets[ticket.ticket] = ticket
            self._start_read(tid)
        return PullReply(
            tid,
            data_port=self._data_port,
            ticket=ticket.ticket,
            stripes=len(stripes),
            nbytes=units * kv.unit_bytes,
        )

    def _fail_ticket(self, ticket: _Ticket) -> None:
        """Under the lock: stop a ticket's stripes; it ends once none is being sent."""
        ticket.failed = True
        for conn in ticket.socks:
            shutdown(conn)
        self._settle_ticket(ticket)

    def _settle_ticket(self, ticket: _Ticket) -> None:
        """Under the lock: end a ticket that is fully sent, or failed with no stripe moving."""
        if self._tickets.get(ticket.ticket) is not ticket:
            return
        done = ticket.sent == len(ticket.stripes)
        if not done and not (ticket.failed and ticket.active == 0):
            return
        del self._tickets[ticket.ticket]
        self._end_read(ticket.transfer_id)
        if done:
            self.blocks_sent += len(ticket.block_ids)
            self.bytes_sent += ticket.kv.num_units(len(ticket.block_ids)) * ticket.kv.unit_bytes

    def _expire_producer(self, now: float) -> None:
        """Control thread: end expired tickets, drop connections that never said hello."""
        with self._lock:
            for ticket in [t for t in self._tickets.values() if t.deadline <= now]:
                self._fail_ticket(ticket)
        for fd in [fd for fd, h in self._hellos.items() if h.deadline <= now]:
            self._drop_hello(fd, f"no stripe named within {HELLO_TIMEOUT_S:g} s")

    # -- control thread: payload connections -----------------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                conn, address = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self._warn("accepting a KV payload connection: %s", e)
                return
            peer = address[0]
            with self._lock:
                refuse = (
                    self._closed
                    or self._peer_conns[peer] >= MAX_CONNS_PER_PEER
                    or len(self._hellos) >= MAX_PENDING_HELLOS
                )
                if not refuse:
                    self._peer_conns[peer] += 1
                    self._conns.add(conn)
            if refuse:
                conn.close()
                if not self._closed:
                    self._warn("refused a KV payload connection from %s: too many open", peer)
                continue
            conn.setblocking(False)
            self._hellos[conn.fileno()] = PendingHello(
                conn, peer, time.monotonic() + HELLO_TIMEOUT_S
            )
            self._poller.register(conn, zmq.POLLIN)

    def _on_hello(self, fd: int) -> None:
        """A waiting payload connection is readable: once its hello is whole, hand it a sender."""
        hello = self._hellos[fd]
        try:
            body = hello.feed()
            if body is None:
                return
            msg = self._stripe_decoder.decode(body)
        except (OSError, ValueError, msgspec.DecodeError) as e:
            self._drop_hello(fd, str(e))
            return
        error = self.seal.check(msg)
        with self._lock:
            ticket = self._tickets.get(msg.ticket)
            if error is None and (
                ticket is None
                or ticket.failed
                or self._closed
                or not 0 <= msg.index < len(ticket.stripes)
                or msg.index in ticket.claimed
            ):
                error = "an unknown, expired or already claimed stripe"
            if error is None:
                ticket.claimed.add(msg.index)
                ticket.active += 1
                ticket.socks.add(hello.conn)
        if error is not None:
            self._drop_hello(fd, error)
            return
        self._poller.unregister(hello.conn)
        del self._hellos[fd]
        hello.conn.setblocking(True)  # the ticket's expiry shuts it down
        hello.conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._senders.submit(self._send_stripe, hello.conn, hello.peer, ticket, msg.index)

    def _drop_hello(self, fd: int, why: str) -> None:
        hello = self._hellos.pop(fd)
        self._poller.unregister(hello.conn)
        self._warn("dropped a KV payload connection from %s: %s", hello.peer, why)
        with self._lock:
            self._forget_conn(hello.conn, hello.peer)

    def _forget_conn(self, conn: socket.socket, peer: str) -> None:
        """Under the lock: a payload connection is over."""
        if conn in self._conns:
            self._conns.discard(conn)
            self._peer_conns[peer] -= 1
            if not self._peer_conns[peer]:
                del self._peer_conns[peer]
        conn.close()

    def _close_hellos(self) -> None:
        for fd in list(self._hellos):
            hello = self._hellos.pop(fd)
            with self._lock:
                self._forget_conn(hello.conn, hello.peer)

    # -- sender threads --------------------------------------------------------------------------

    def _send_stripe(self, conn: socket.socket, peer: str, ticket: _Ticket, index: int) -> None:
        ok = False
        try:
            start, end = ticket.stripes[index]
            self._send_units(conn, ticket, start, end)
            ok = True
        except OSError as e:
            log.info("KV stripe not sent: %s", e)
        except Exception:
            log.exception("sending a KV stripe")
        finally:
            with self._lock:
                ticket.socks.discard(conn)
                ticket.active -= 1
                if ok:
                    ticket.sent += 1
                    self._settle_ticket(ticket)
                else:
                    self._fail_ticket(ticket)  # the consumer fails the pull anyway
                self._forget_conn(conn, peer)

    def _send_units(self, conn: socket.socket, ticket: _Ticket, start: int, end: int) -> None:
        kv = ticket.kv
        if kv.direct:
            send_views(conn, kv.views(ticket.block_ids, start, end))
            return
        parts = chunks(start, end, self._chunk_units)
        index = kv.block_index(ticket.block_ids)
        with self.staging.pair() as (bufs, done):  # each buffer's gather event
            a, b = parts[0]
            done[0] = kv.gather(index, a, b, bufs[0][0], ticket.fence)
            for k, (a, b) in enumerate(parts):
                if k + 1 < len(parts):  # the next chunk's copy overlaps this one's send
                    na, nb = parts[k + 1]
                    nxt = (k + 1) % 2
                    done[nxt] = kv.gather(index, na, nb, bufs[nxt][0], ticket.fence)
                i = k % 2
                if done[i] is not None:
                    done[i].synchronize()
                    done[i] = None
                conn.sendall(bufs[i][1][: (b - a) * kv.unit_bytes])

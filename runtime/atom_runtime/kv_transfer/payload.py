"""Payload sockets of the portable transport: length-prefixed hello frames, exact reads and
writes over many buffers, the staging buffers of a GPU cache, and a payload connection that has
not named its stripe yet (read without blocking, so it takes no sender thread while it idles).

Payload sockets block (no Python timeout) and receive with MSG_WAITALL, so one system call moves
a whole chunk or view batch without returning to Python: a busy engine thread holding the GIL
then costs one switch per chunk, not one per socket-buffer refill. Deadlines are enforced by the
control thread, which shuts a late stripe's sockets down (that wakes the blocked call).
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Iterator

import torch

CHUNK_BYTES = 8 << 20  # a staged stripe moves in chunks of about this size
IOV_BATCH = 512  # views per sendmsg/recvmsg_into call (Linux allows 1024)
MAX_HELLO_BYTES = 4096
_WAITALL = getattr(socket, "MSG_WAITALL", 0)


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

    @contextlib.contextmanager
    def pair(self) -> Iterator[tuple[list, list]]:
        """Two buffers for a double-buffered stripe and their copy events (None: no copy
        pending); on leaving, every pending copy is waited for and both buffers come back."""
        bufs = [self.acquire(), self.acquire()]
        done: list = [None, None]
        try:
            yield bufs, done
        finally:
            for event in done:
                if event is not None:
                    event.synchronize()  # a copy still touching a buffer we give back
            for buf in bufs:
                self.release(buf)

    def release(self, buf: tuple[torch.Tensor, memoryview]) -> None:
        with self._cond:
            self._free.append(buf)
            self._cond.notify()


class PendingHello:
    """An accepted payload connection until its `Stripe` frame is complete: fed by the control
    thread whenever the socket is readable, never blocking, dropped at `deadline`."""

    def __init__(self, conn: socket.socket, peer: str, deadline: float) -> None:
        self.conn, self.peer, self.deadline = conn, peer, deadline
        self._buf = bytearray()

    def feed(self) -> bytes | None:
        """The hello's body once all of it arrived, else None. Raises ConnectionError (closed
        early) or ValueError (an oversized frame)."""
        try:
            data = self.conn.recv(MAX_HELLO_BYTES + 4 - len(self._buf))
        except (BlockingIOError, InterruptedError):
            return None
        if not data:
            raise ConnectionError("closed before naming its stripe")
        self._buf += data
        if len(self._buf) < 4:
            return None
        (size,) = struct.unpack(">I", self._buf[:4])
        if size > MAX_HELLO_BYTES:
            raise ValueError(f"a {size}-byte stripe header")
        if len(self._buf) < 4 + size:
            return None
        if len(self._buf) > 4 + size:
            raise ValueError("bytes after the stripe header")
        return bytes(self._buf[4:])


def chunks(start: int, end: int, size: int) -> list[tuple[int, int]]:
    return [(a, min(a + size, end)) for a in range(start, end, size)]


def size_buffers(sock: socket.socket, nbytes: int) -> None:
    if nbytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, nbytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, nbytes)


def shutdown(sock: socket.socket) -> None:
    """Wake a thread blocked on `sock` (the owner closes it); call under the owner's lock."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # not connected yet, or already closed


def frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def recv_exact(sock: socket.socket, view: memoryview) -> None:
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


def send_views(sock: socket.socket, views: list[memoryview]) -> None:
    i = 0
    while i < len(views):
        i = _advance(views, i, sock.sendmsg(views[i : i + IOV_BATCH]))


def recv_views(sock: socket.socket, views: list[memoryview]) -> None:
    total, i = sum(len(v) for v in views), 0
    got = 0
    while i < len(views):
        n = sock.recvmsg_into(views[i : i + IOV_BATCH], 0, _WAITALL)[0]
        if n == 0:
            raise ConnectionError(f"closed by the peer after {got} of {total} bytes")
        got += n
        i = _advance(views, i, n)

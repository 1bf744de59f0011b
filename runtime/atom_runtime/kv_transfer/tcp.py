"""The portable KV transport: ZMQ over TCP, msgspec headers, raw block bytes, no pickle.

Producer: a ROUTER socket on kv_ip:kv_port answers `Pull(transfer_id, block_ids, layout)` with
`[PullReply, payload]` (payload = the blocks in KVCacheAccess's wire layout) and records
`Release(transfer_id)`. Consumer: one DEALER per producer address; a pull that gets no answer
within its timeout fails (the engine then prefills locally). One background thread owns every
socket; the engine thread talks to it through an inproc PUSH socket and reads results from
locked lists, so ZMQ sockets never cross threads.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque

import msgspec
import zmq

from atom_runtime.kv_transfer.base import KVCacheAccess, KVConnector, PullResult, RemoteBlocks
from atom_runtime.kv_transfer.config import KVTransferConfig

log = logging.getLogger(__name__)


class Pull(msgspec.Struct, tag=True):
    transfer_id: str
    block_ids: list[int]
    layout: str


class PullReply(msgspec.Struct, tag=True):
    transfer_id: str
    error: str | None = None  # None: the payload frame follows


class Release(msgspec.Struct, tag=True):
    transfer_id: str


class _StartPull(msgspec.Struct, tag=True):
    transfer_id: str
    host: str
    port: int
    block_ids: list[int]
    deadline: float


class _Cancel(msgspec.Struct, tag=True):
    transfer_id: str


class _ReleaseRemote(msgspec.Struct, tag=True):
    host: str
    port: int
    transfer_id: str


class _Stop(msgspec.Struct, tag=True):
    pass


_WIRE = Pull | PullReply | Release
_COMMANDS = _StartPull | _Cancel | _ReleaseRemote | _Stop


class TCPConnector(KVConnector):
    def __init__(self, config: KVTransferConfig, kv: KVCacheAccess) -> None:
        self.config = config
        self.kv = kv
        self.engine_id = uuid.uuid4().hex
        self._ctx = zmq.Context()
        self._encoder = msgspec.msgpack.Encoder()
        self._wire = msgspec.msgpack.Decoder(_WIRE)
        self._commands = msgspec.msgpack.Decoder(_COMMANDS)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        # Producer state, shared with the thread under the lock.
        self._offers: dict[str, set[int]] = {}
        self._reading: dict[str, int] = {}
        self._released: list[str] = []
        # Consumer state: results for the engine.
        self._results: deque[PullResult] = deque()
        self.blocks_sent = 0
        self.bytes_sent = 0

        self._router: zmq.Socket | None = None
        self._port = config.kv_port
        if config.is_producer:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            host = "*" if config.kv_ip in ("0.0.0.0", "::", "*") else config.kv_ip
            try:
                router.bind(f"tcp://{host}:{config.kv_port}")
            except zmq.ZMQError as e:
                router.close()
                self._ctx.term()
                raise ValueError(
                    f"kv_transfer_config.kv_port: cannot listen on {host}:{config.kv_port} ({e})"
                ) from None
            self._router = router
        inproc = f"inproc://kv-transfer-{self.engine_id}"
        self._cmd_pull = self._ctx.socket(zmq.PULL)
        self._cmd_pull.bind(inproc)
        self._cmd_push = self._ctx.socket(zmq.PUSH)  # the engine thread's end
        self._cmd_push.connect(inproc)
        self._advertised = config.advertise_host()
        self._thread = threading.Thread(target=self._run, name="kv-transfer", daemon=True)
        self._thread.start()

    # -- engine thread: producer -----------------------------------------------------------------

    def address(self) -> tuple[str, int]:
        return self._advertised, self._port

    def offer(self, transfer_id: str, block_ids: list[int]) -> None:
        with self._lock:
            self._offers[transfer_id] = set(block_ids)

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

    def start_pull(self, remote: RemoteBlocks, timeout_s: float) -> None:
        self._command(
            _StartPull(
                remote.transfer_id,
                remote.host,
                remote.port,
                list(remote.block_ids),
                time.monotonic() + timeout_s,
            )
        )

    def cancel_pull(self, transfer_id: str) -> None:
        self._command(_Cancel(transfer_id))

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
        if self._thread.is_alive():
            log.warning("KV transfer thread did not stop; leaving its sockets to the process")
            return
        self._ctx.term()

    def _command(self, msg: msgspec.Struct) -> None:
        self._cmd_push.send(self._encoder.encode(msg))

    # -- the transport thread --------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._cmd_pull, zmq.POLLIN)
        if self._router is not None:
            poller.register(self._router, zmq.POLLIN)
        dealers: dict[tuple[str, int], zmq.Socket] = {}
        pending: dict[str, float] = {}  # transfer id -> deadline
        try:
            while True:
                for sock, _ in poller.poll(50):
                    if sock is self._cmd_pull:
                        if not self._on_commands(poller, dealers, pending):
                            return
                    elif sock is self._router:
                        self._serve(sock)
                    else:
                        self._on_reply(sock, pending)
                now = time.monotonic()
                for tid in [t for t, deadline in pending.items() if deadline <= now]:
                    del pending[tid]
                    self._finish(PullResult(tid, None, "the producer did not answer in time"))
        except Exception:
            log.exception("KV transfer thread failed")
            for tid in list(pending):
                self._finish(PullResult(tid, None, "the KV transfer thread failed"))
        finally:
            for sock in [self._cmd_pull, *dealers.values()]:
                sock.close(linger=0)
            if self._router is not None:
                self._router.close(linger=0)

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

    def _on_commands(self, poller, dealers, pending) -> bool:
        while True:
            try:
                raw = self._cmd_pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True
            cmd = self._commands.decode(raw)
            if isinstance(cmd, _Stop):
                return False
            if isinstance(cmd, _StartPull):
                pending[cmd.transfer_id] = cmd.deadline
                sock = self._dealer(poller, dealers, cmd.host, cmd.port)
                msg = Pull(cmd.transfer_id, cmd.block_ids, self.kv.layout)
                try:
                    sock.send(self._encoder.encode(msg), zmq.NOBLOCK)
                except zmq.Again:
                    del pending[cmd.transfer_id]
                    self._finish(PullResult(cmd.transfer_id, None, "the producer is unreachable"))
            elif isinstance(cmd, _Cancel):
                pending.pop(cmd.transfer_id, None)
            elif isinstance(cmd, _ReleaseRemote):
                sock = self._dealer(poller, dealers, cmd.host, cmd.port)
                try:
                    sock.send(self._encoder.encode(Release(cmd.transfer_id)), zmq.NOBLOCK)
                except zmq.Again:
                    pass  # the producer is gone; its hold times out on its side

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
                self._answer_pull(router, ident, msg)

    def _answer_pull(self, router: zmq.Socket, ident: bytes, msg: Pull) -> None:
        tid = msg.transfer_id
        error = None
        with self._lock:
            offered = self._offers.get(tid)
            if offered is None:
                error = f"transfer {tid} is unknown here (released or timed out)"
            elif not set(msg.block_ids) <= offered:
                error = f"transfer {tid}: blocks {sorted(set(msg.block_ids) - offered)} not held"
            elif msg.layout != self.kv.layout:
                error = f"KV layout {msg.layout} does not match this engine's {self.kv.layout}"
            else:
                self._reading[tid] = self._reading.get(tid, 0) + 1
        if error is not None:
            router.send_multipart([ident, self._encoder.encode(PullReply(tid, error))])
            return
        try:
            payload = self.kv.read(msg.block_ids)
        except Exception as e:  # a read must not kill the transport
            log.exception("reading KV blocks for transfer %s", tid)
            router.send_multipart(
                [ident, self._encoder.encode(PullReply(tid, f"read failed: {e}"))]
            )
            return
        finally:
            with self._lock:
                self._reading[tid] -= 1
                if not self._reading[tid]:
                    del self._reading[tid]
        router.send_multipart([ident, self._encoder.encode(PullReply(tid)), payload], copy=False)
        self.blocks_sent += len(msg.block_ids)
        self.bytes_sent += len(payload)

    def _on_reply(self, sock: zmq.Socket, pending: dict[str, float]) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                reply = self._wire.decode(frames[0].buffer)
            except msgspec.DecodeError:
                continue
            if not isinstance(reply, PullReply) or reply.transfer_id not in pending:
                continue  # cancelled or timed out already: drop the late answer
            del pending[reply.transfer_id]
            if reply.error is not None:
                self._finish(PullResult(reply.transfer_id, None, reply.error))
            elif len(frames) != 2:
                self._finish(PullResult(reply.transfer_id, None, "reply without payload"))
            else:
                self._finish(PullResult(reply.transfer_id, frames[1].buffer))

    def _finish(self, result: PullResult) -> None:
        with self._lock:
            self._results.append(result)
        self._wake.set()

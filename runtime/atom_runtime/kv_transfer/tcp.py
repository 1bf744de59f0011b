"""The portable KV transport: ZMQ for control, plain TCP for the payload, no pickle.

Control (ZMQ over TCP, msgspec msgpack headers sealed with the deployment's transfer key,
kv_transfer/wire.py): the producer's ROUTER socket on kv_ip:kv_port answers `Pull` with a
`PullReply` that names an error or grants a ticket (payload port, ticket id, stripe count, byte
count), and records `Release`. A consumer keeps one DEALER per producer address; a pull that is
not done within its timeout fails (the engine then prefills locally).

Payload (plain TCP): the payload in KVCacheAccess's wire layout is cut into contiguous stripes of
whole units (`plan_stripes`). The consumer opens one connection per stripe to the producer's data
port, sends a sealed `Stripe(ticket, index)` (a 4-byte big-endian length, then msgpack) and
reads exactly that stripe's bytes; nothing else travels on a payload connection.

Threads: one control thread owns every ZMQ socket, the data listener and the payload
connections that have not yet named their stripe. Stripes move on `streams` worker threads per
role, in arrival order: a queued pull waits for the one ahead of it rather than sharing its
bandwidth. A pull appears in `completed()` only once its bytes are in the cache, so the engine
thread never waits on a transfer. The producer's side is kv_transfer/producer.py, the
consumer's kv_transfer/consumer.py, the socket helpers kv_transfer/payload.py.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import msgspec
import zmq

from atom_runtime.kv_transfer.base import KVCacheAccess, KVConnector, Wakeup
from atom_runtime.kv_transfer.config import WILDCARDS, KVTransferConfig
from atom_runtime.kv_transfer.consumer import ConsumerSide
from atom_runtime.kv_transfer.holds import bind_control
from atom_runtime.kv_transfer.payload import CHUNK_BYTES, StagingPool, shutdown, size_buffers
from atom_runtime.kv_transfer.producer import LOG_INTERVAL_S, ProducerSide
from atom_runtime.kv_transfer.pulls import open_dealer, waiting_messages
from atom_runtime.kv_transfer.wire import WIRE, WireSeal
from atom_runtime.system.log_limit import RateLimitedLog

log = logging.getLogger(__name__)

_REPLY_MAX_BYTES = 64 << 10


class _StartPull(msgspec.Struct, tag=True):
    transfer_id: str


class _ReleaseRemote(msgspec.Struct, tag=True):
    host: str
    port: int
    transfer_id: str


class _Stop(msgspec.Struct, tag=True):
    pass


_COMMANDS = _StartPull | _ReleaseRemote | _Stop


class TCPConnector(ProducerSide, ConsumerSide, KVConnector):
    def __init__(
        self,
        config: KVTransferConfig,
        kv: KVCacheAccess,
        chunk_bytes: int = CHUNK_BYTES,
        wake: Wakeup | None = None,
    ) -> None:
        self.config = config
        self.kv = kv
        self.engine_id = uuid.uuid4().hex
        self.streams = config.streams
        self.seal = WireSeal(config.load_key())
        self._chunk_units = max(1, chunk_bytes // kv.unit_bytes)
        self._ctx = zmq.Context()
        self._encoder = msgspec.msgpack.Encoder()
        self._wire = msgspec.msgpack.Decoder(WIRE)
        self._commands = msgspec.msgpack.Decoder(_COMMANDS)
        self._lock = threading.Lock()
        self._wake = wake if wake is not None else threading.Event()
        self._closed = False
        self._warn = RateLimitedLog(log, LOG_INTERVAL_S)
        self._poller = zmq.Poller()
        self._init_producer()
        self._init_consumer()

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
        """The control ROUTER and the payload listener, on the pod's address unless kv_ip asks
        for another (a wildcard only when given)."""
        config = self.config
        try:
            router = bind_control(self._ctx, config, self.kv.caches[0].shape[0])
        except ValueError:
            self._ctx.term()
            raise
        ip = config.bind_host()
        wildcard = ip in WILDCARDS
        ip = ("::" if ip == "::" else "0.0.0.0") if wildcard else ip
        listener = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            size_buffers(listener, config.socket_buffer_bytes)  # accepted sockets inherit them
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

    # -- engine thread ---------------------------------------------------------------------------

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
                shutdown(conn)
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

    def _command_pull(self, transfer_id: str) -> None:
        self._command(_StartPull(transfer_id))

    def _command_release(self, host: str, port: int, transfer_id: str) -> None:
        self._command(_ReleaseRemote(host, port, transfer_id))

    # -- the control thread ----------------------------------------------------------------------

    def _run(self) -> None:
        poller = self._poller
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
                        if not self._on_commands(dealers):
                            return
                    elif sock is self._router:
                        self._serve(sock)
                    elif sock == listen_fd:  # a plain socket: the poller hands back its fd
                        self._accept()
                    elif sock in self._hellos:
                        self._on_hello(sock)
                    else:
                        self._on_reply(sock)
                now = time.monotonic()
                self._expire_consumer(now)
                self._expire_producer(now)
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
            self._close_hellos()
            if self._router is not None:
                self._router.close(linger=0)
                self._listener.close()

    def _dealer(self, dealers, host: str, port: int) -> zmq.Socket:
        sock = dealers.get((host, port))
        if sock is None:
            sock = open_dealer(self._ctx, self._poller, host, port, _REPLY_MAX_BYTES)
            dealers[(host, port)] = sock
        return sock

    def _on_commands(self, dealers) -> bool:
        for cmd in waiting_messages(self._cmd_pull, self._commands):
            if isinstance(cmd, _Stop):
                return False
            if isinstance(cmd, _StartPull):
                with self._lock:
                    job = self._pulls.get(cmd.transfer_id)
                if job is None:
                    continue  # cancelled before it was sent
                sock = self._dealer(dealers, job.remote.host, job.remote.port)
                self._send_pull(sock, cmd.transfer_id)
            elif isinstance(cmd, _ReleaseRemote):
                sock = self._dealer(dealers, cmd.host, cmd.port)
                self._send_release(sock, cmd.transfer_id)
        return True

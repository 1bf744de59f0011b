"""The NIXL KV transport (`"kv_connector": "NixlConnector"`, vLLM's name): the consumer reads
the producer's blocks directly, one-sided, into its own blocks.

Each engine rank creates one NIXL agent (UCX backend unless `kv_connector_extra_config.backends`
names others) and registers its KV cache tensors with it once (GPU memory as VRAM, a CPU cache
as DRAM); a hybrid model's state checkpoints live in KV blocks, so they are registered too. UCX
then picks the path per peer: shared memory or TCP between host caches, CUDA IPC between GPUs of
one node, RDMA (InfiniBand, RoCE) across nodes. Nothing passes through host memory on the way
from a GPU cache to a GPU cache.

Control is this module's: ZMQ on the producer rank's control port (kv_port + its rank), the
messages sealed with the deployment's transfer key (nixl_wire.py). NIXL's own listener and
metadata server are off: agent metadata travels only in sealed grants, to consumers that hold
the key. The data path is UCX's own connections, which authenticate nothing: keep the pods'
network to the deployment (docs/disaggregation.md, docs/security.md).

Threads: one control thread makes every NIXL call (it owns the agent), every ZMQ socket but the
engine thread's command socket, and polls posted reads (each millisecond while any is in
flight); NIXL's progress thread drives UCX. `NixlProducer` (nixl_producer.py) and
`NixlConsumer` (nixl_consumer.py) are its two sides.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

import msgspec
import zmq

from atom_runtime.kv_transfer.base import KVCacheAccess, KVConnector, Wakeup
from atom_runtime.kv_transfer.config import KVTransferConfig
from atom_runtime.kv_transfer.holds import bind_control
from atom_runtime.kv_transfer.nixl_consumer import NixlConsumer
from atom_runtime.kv_transfer.nixl_descs import CacheGeometry
from atom_runtime.kv_transfer.nixl_lib import load_nixl
from atom_runtime.kv_transfer.nixl_producer import NixlProducer
from atom_runtime.kv_transfer.nixl_wire import MAX_GRANT_BYTES, NIXL_WIRE, NixlGrant, nixl_seal
from atom_runtime.kv_transfer.pulls import open_dealer, waiting_messages
from atom_runtime.system.log_limit import RateLimitedLog

log = logging.getLogger(__name__)
_COMMANDS = msgspec.msgpack.Decoder()  # the engine thread's commands to the control thread

LOG_INTERVAL_S = 10.0
BUSY_POLL_MS = 1  # how often posted reads are polled
IDLE_POLL_MS = 50


class NixlConnector(NixlProducer, NixlConsumer, KVConnector):
    def __init__(
        self, config: KVTransferConfig, kv: KVCacheAccess, wake: Wakeup | None = None
    ) -> None:
        nixl = load_nixl()
        self.config = config
        self.kv = kv
        self.engine_id = uuid.uuid4().hex
        self.seal = nixl_seal(config.load_key())
        self.agent_name = f"atom-{self.engine_id}"
        backends = list(config.kv_connector_extra_config.get("backends") or ["UCX"])
        # NIXL's own metadata listener stays off: agent metadata travels only in sealed grants.
        agent_config = nixl.nixl_agent_config(enable_listen_thread=False, backends=backends)
        self.agent = nixl.nixl_agent(self.agent_name, agent_config)
        if not self.agent.backends:
            raise ValueError(
                f"kv_transfer_config.kv_connector_extra_config.backends: none of {backends} is "
                f"available in {nixl.name} (has {', '.join(self.agent.plugin_list) or 'none'})"
            )
        self._registered = self.agent.register_memory(kv.full_caches)
        self.geometry = CacheGeometry.of(kv)
        self.metadata = self.agent.get_agent_metadata()
        self._ctx = zmq.Context()
        self._encoder = msgspec.msgpack.Encoder()
        self._wire = msgspec.msgpack.Decoder(NIXL_WIRE)
        self._lock = threading.Lock()
        self._wake = wake if wake is not None else threading.Event()
        self._warn = RateLimitedLog(log, LOG_INTERVAL_S)
        self._poller = zmq.Poller()
        self._dealers: dict[tuple[str, int], zmq.Socket] = {}
        self._address_of: dict[zmq.Socket, tuple[str, int]] = {}
        self._init_producer()
        self._init_consumer()
        self._port = config.kv_port
        self._advertised = config.advertise_host()
        self._router = None
        if config.is_producer:
            try:
                self._router = bind_control(self._ctx, config, kv.full_caches[0].shape[0])
            except ValueError:
                self._ctx.term()
                raise
        inproc = f"inproc://kv-nixl-{self.engine_id}"
        self._cmd_pull = self._ctx.socket(zmq.PULL)
        self._cmd_pull.bind(inproc)
        self._cmd_push = self._ctx.socket(zmq.PUSH)  # the engine thread's end
        self._cmd_push.connect(inproc)
        self._thread = threading.Thread(target=self._run, name="kv-nixl", daemon=True)
        self._thread.start()
        log.info(
            "NIXL KV transfer (%s, %s): %d cache tensors of %s memory registered",
            nixl.name, ", ".join(backends), len(kv.full_caches), self.geometry.memory,
        )  # fmt: skip

    # -- engine thread ---------------------------------------------------------------------------

    def wait(self, timeout_s: float) -> None:
        self._wake.wait(timeout_s)
        self._wake.clear()

    def close(self) -> None:
        if self._thread.is_alive():
            self._command(("stop",))
            self._thread.join(10)
        self._cmd_push.close(linger=0)
        if self._thread.is_alive():
            log.warning("NIXL transfer thread did not stop; leaving its agent to the process")
            return
        try:
            self.agent.deregister_memory(self._registered)
        except Exception:
            log.debug("deregistering the KV cache from NIXL", exc_info=True)
        self._ctx.term()

    def _command(self, cmd: tuple) -> None:
        self._cmd_push.send(self._encoder.encode(cmd))

    # -- the control thread ----------------------------------------------------------------------

    def _run(self) -> None:
        poller = self._poller
        poller.register(self._cmd_pull, zmq.POLLIN)
        if self._router is not None:
            poller.register(self._router, zmq.POLLIN)
        try:
            while True:
                busy = any(j.xfer is not None for j in list(self._pulls.values()))
                for sock, _ in poller.poll(BUSY_POLL_MS if busy else IDLE_POLL_MS):
                    if sock is self._cmd_pull:
                        if not self._on_commands():
                            return
                    elif sock is self._router:
                        # A finished read's note comes before its consumer's Release: take the
                        # notes first, so the read counts as sent, not as abandoned.
                        self._take_notes()
                        self._serve(sock)
                    else:
                        self._on_replies(sock)
                self._progress_reads()
                if self._router is not None:
                    self._take_notes()
                now = time.monotonic()
                self._expire_consumer(now)
                self._expire_producer(now)
        except Exception:
            log.exception("NIXL transfer thread failed")
        finally:
            self._stop_all()

    def _stop_all(self) -> None:
        """The thread is ending: every pull fails (reads still in flight are aborted first),
        and every socket closes."""
        deadline = time.monotonic() + 5.0
        with self._lock:
            for job in self._pulls.values():
                job.error = job.error or "the KV transfer thread stopped"
        while time.monotonic() < deadline and any(
            j.xfer is not None for j in list(self._pulls.values())
        ):
            self._progress_reads()
            time.sleep(0.001)
        with self._lock:
            for job in list(self._pulls.values()):
                if job.xfer is None:
                    self._fail(job, job.error)
        for sock in [self._cmd_pull, *self._dealers.values()]:
            sock.close(linger=0)
        if self._router is not None:
            self._router.close(linger=0)

    def _on_commands(self) -> bool:
        for cmd in waiting_messages(self._cmd_pull, _COMMANDS):
            if cmd[0] == "stop":
                return False
            if cmd[0] == "pull":
                self._send_pull(cmd[1])
            elif cmd[0] == "release":
                self._send_release(cmd[1], cmd[2], cmd[3])
        return True

    def _dealer(self, host: str, port: int) -> zmq.Socket:
        sock = self._dealers.get((host, port))
        if sock is None:
            sock = open_dealer(self._ctx, self._poller, host, port, MAX_GRANT_BYTES)
            self._dealers[(host, port)] = sock
            self._address_of[sock] = (host, port)
        return sock

    def _on_replies(self, sock: zmq.Socket) -> None:
        for grant in waiting_messages(sock, self._wire):
            if isinstance(grant, NixlGrant):
                self._on_grant(grant, self._address_of[sock])

"""Publishing KV events from the engine without ever blocking it (contracts 4 and 5,
docs/architecture.md).

The engine calls `publish(events)` once per step. The ZMQ publisher only appends the step's batch
to a bounded in-memory queue; when the queue is full the OLDEST batch is dropped and counted. One
background thread owns every socket: it encodes each batch with msgpack and sends the PUB frames
`[topic, seq (8 bytes big-endian), payload]`, keeps the last `buffer_steps` payloads for replay, and
answers replay requests on a ROUTER socket.

Sequence numbers are given in `publish`, not when sending: a batch dropped from the full queue
leaves a hole in the numbering, so subscribers see the loss as a gap instead of never knowing.
(vLLM numbers batches at send time, so its queue drops are invisible on the wire.)

A failure in the thread (a batch msgpack cannot encode, a socket error) is kept and re-raised in
the engine by `raise_if_failed()` and by the next `publish()`; the publisher stops at that point.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Protocol

import msgspec
import zmq

from atom_runtime.kv_events.config import KVEventsConfig, endpoint_binds
from atom_runtime.kv_events.curve import CurveKeys, start_authenticator
from atom_runtime.kv_events.events import EventBatch, KVCacheEvent
from atom_runtime.system.log_limit import RateLimitedLog

logger = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
# Batches sent between two looks at the replay socket while the queue is backed up.
_SEND_BURST = 64
# A replay request is [identity, b"", start_seq (8 bytes)]. libzmq disconnects a peer that sends a
# bigger frame before it is ever buffered whole, and frames past the third are read and dropped,
# so no client can make the engine hold more than a few hundred bytes for one request.
REPLAY_MAX_FRAME_BYTES = 256
_REPLAY_MAX_FRAMES = 3
# Malformed replay requests are counted one by one but logged at most once per this many seconds.
REPLAY_WARNING_INTERVAL_S = 10.0


class KVEventPublisherError(RuntimeError):
    """The background sender failed; raised in the engine's thread."""


class EventPublisher(Protocol):
    def publish(self, events: list[KVCacheEvent]) -> None: ...
    def raise_if_failed(self) -> None: ...
    def shutdown(self, timeout: float = 5.0) -> None: ...
    @property
    def published_total(self) -> int: ...
    @property
    def dropped_total(self) -> int: ...


def _check_events(events: object) -> None:
    if type(events) is not list:
        raise TypeError(f"publish() takes a list of KV events, got {type(events).__name__}")
    for event in events:
        if not isinstance(event, KVCacheEvent):
            raise TypeError(f"publish() got a {type(event).__name__}, not a KV event")


class NullEventPublisher:
    """Events disabled: checks the argument, sends nothing."""

    def publish(self, events: list[KVCacheEvent]) -> None:
        _check_events(events)

    def raise_if_failed(self) -> None:
        return None

    def shutdown(self, timeout: float = 5.0) -> None:
        return None

    @property
    def published_total(self) -> int:
        return 0

    @property
    def dropped_total(self) -> int:
        return 0


class ZmqEventPublisher:
    """PUB socket + replay ROUTER, fed from a bounded drop-oldest queue by one sender thread."""

    def __init__(
        self,
        config: KVEventsConfig,
        data_parallel_rank: int = 0,
        *,
        context: zmq.Context | None = None,
    ) -> None:
        self._rank = data_parallel_rank
        self._endpoint = config.publish_endpoint(data_parallel_rank)
        self._replay_endpoint = config.replay_publish_endpoint(data_parallel_rank)
        self._hwm = config.hwm
        self._topic = config.topic.encode("utf-8")
        self._curve: CurveKeys | None = None
        self._auth = None
        if config.curve_keys_dir is not None:
            self._curve = CurveKeys.for_publisher(config.curve_keys_dir, "curve_keys_dir")
            # A ZAP authenticator takes its context's one ZAP endpoint: a context of our own.
            context = zmq.Context()
        self._own_context = config.curve_keys_dir is not None
        self._ctx = context if context is not None else zmq.Context.instance()

        # Shared with the sender thread, guarded by _lock.
        self._lock = threading.Lock()
        self._queue: collections.deque[tuple[int, EventBatch]] = collections.deque()
        self._max_queue = config.max_queue_size
        self._next_seq = 0
        self._dropped = 0
        self._sleeping = False
        self._closing = False
        self._abandon = False
        self._shut_down = False

        # Written by the sender thread only.
        self._published = 0
        self._replay_errors = 0
        self._warn_replay = RateLimitedLog(logger, REPLAY_WARNING_INTERVAL_S)
        self._failure: BaseException | None = None
        self._ring: collections.deque[tuple[int, bytes]] = collections.deque(
            maxlen=config.buffer_steps
        )
        self.bound_endpoint: str | None = None
        self.bound_replay_endpoint: str | None = None

        # The engine wakes a sleeping sender through a pipe, so the engine touches no socket.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"kv-events-publisher-dp{data_parallel_rank}", daemon=True
        )
        self._thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            self._thread.join()
            self._close_pipe()
            raise self._startup_error

    # ---- engine side ---------------------------------------------------------------------

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Queue one step's events as one batch; never blocks on the network."""
        self.raise_if_failed()
        _check_events(events)
        if not events:
            return
        batch = EventBatch(ts=time.time(), events=events, data_parallel_rank=self._rank)
        with self._lock:
            if self._closing:
                raise RuntimeError("publish() after shutdown()")
            if len(self._queue) >= self._max_queue:
                self._queue.popleft()
                self._dropped += 1
            self._queue.append((self._next_seq, batch))
            self._next_seq += 1
            wake = self._sleeping
            self._sleeping = False
        if wake:
            os.write(self._wake_w, b"\0")

    def raise_if_failed(self) -> None:
        """Re-raise, in the caller, a failure of the sender thread (sticky)."""
        failure = self._failure
        if failure is not None:
            raise KVEventPublisherError(f"KV event publisher failed: {failure!r}") from failure

    def shutdown(self, timeout: float = 5.0) -> None:
        """Send what is queued (within `timeout` seconds), then close the sockets."""
        with self._lock:
            if self._shut_down:
                return
            self._shut_down = True
            self._closing = True
            self._sleeping = False
        os.write(self._wake_w, b"\0")
        self._thread.join(timeout)
        if self._thread.is_alive():
            # Out of time: drop what is left (counted) and stop.
            with self._lock:
                self._abandon = True
            os.write(self._wake_w, b"\0")
            self._thread.join()
        self._close_pipe()

    @property
    def published_total(self) -> int:
        """Batches sent on the PUB socket."""
        return self._published

    @property
    def dropped_total(self) -> int:
        """Batches dropped: oldest-first from a full queue, or left unsent at shutdown/failure."""
        return self._dropped

    @property
    def replay_errors_total(self) -> int:
        """Replay answers abandoned (malformed request, or the client could not take them)."""
        return self._replay_errors

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    # ---- sender thread -------------------------------------------------------------------

    def _run(self) -> None:
        pub = replay = None
        try:
            if self._curve is not None:
                self._auth = start_authenticator(self._ctx, self._curve.client_public)
            pub = self._ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.SNDHWM, self._hwm)
            if self._curve is not None:
                self._curve.make_server(pub)
            if endpoint_binds(self._endpoint):
                pub.bind(self._endpoint)
                self.bound_endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                pub.connect(self._endpoint)
            if self._replay_endpoint is not None:
                replay = self._ctx.socket(zmq.ROUTER)
                # Unroutable or over-full answers raise instead of vanishing silently.
                replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
                replay.setsockopt(zmq.SNDHWM, 2 * (self._ring.maxlen or 0) + 16)
                replay.setsockopt(zmq.MAXMSGSIZE, REPLAY_MAX_FRAME_BYTES)
                if self._curve is not None:
                    self._curve.make_server(replay)
                replay.bind(self._replay_endpoint)  # the ROUTER is the server: always bound
                self.bound_replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException as exc:
            self._startup_error = exc
            for sock in (pub, replay):
                if sock is not None:
                    sock.close(linger=0)
            self._close_context()
            self._ready.set()
            return
        self._ready.set()

        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if replay is not None:
            poller.register(replay, zmq.POLLIN)
        encoder = msgspec.msgpack.Encoder()
        try:
            while True:
                burst, stop = self._take(_SEND_BURST)
                for seq, batch in burst:
                    self._send(pub, encoder, seq, batch)
                if stop:
                    break
                for sock, _ in poller.poll(0 if burst else None):
                    if sock is replay:
                        self._answer_replay(replay)
                    else:
                        self._drain_wake_pipe()
        except BaseException as exc:
            self._failure = exc
            logger.error("KV event publisher stopped: %r", exc)
        finally:
            with self._lock:
                self._dropped += len(self._queue)
                self._queue.clear()
                self._closing = True
            pub.close(linger=0 if self._failure is not None else 1000)
            if replay is not None:
                replay.close(linger=0)
            self._close_context()

    def _close_context(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._own_context:
            self._ctx.term()

    def _take(self, limit: int) -> tuple[list[tuple[int, EventBatch]], bool]:
        """Up to `limit` queued batches, and whether the thread should stop after sending them."""
        with self._lock:
            if self._abandon:
                return [], True
            burst = [self._queue.popleft() for _ in range(min(limit, len(self._queue)))]
            if not burst:
                if self._closing:
                    return [], True
                self._sleeping = True
            return burst, False

    def _send(
        self, pub: zmq.Socket, encoder: msgspec.msgpack.Encoder, seq: int, batch: EventBatch
    ) -> None:
        try:
            payload = encoder.encode(batch)
        except Exception as exc:
            with self._lock:
                self._dropped += 1  # the batch that failed
            raise KVEventPublisherError(f"cannot encode KV event batch seq={seq}: {exc}") from exc
        pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), copy=False)
        self._ring.append((seq, payload))
        self._published += 1

    def _answer_replay(self, replay: zmq.Socket) -> None:
        frames, extra = [replay.recv()], 0
        while replay.getsockopt(zmq.RCVMORE):
            frame = replay.recv()
            if len(frames) < _REPLAY_MAX_FRAMES:
                frames.append(frame)
            else:
                extra += 1
        if extra or len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            self._replay_errors += 1
            self._warn_replay(
                "ignoring malformed KV event replay request (%d frames)", len(frames) + extra
            )
            return
        identity, start = frames[0], int.from_bytes(frames[2], "big", signed=True)
        try:
            for seq, payload in list(self._ring):
                if seq >= start:
                    replay.send_multipart(
                        (identity, b"", seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK
                    )
            replay.send_multipart((identity, b"", END_OF_REPLAY, b""), flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            # A client that vanished or stopped reading: its answer is abandoned, the engine is not.
            self._replay_errors += 1
            self._warn_replay("abandoned KV event replay answer: %r", exc)

    def _drain_wake_pipe(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _close_pipe(self) -> None:
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass


def make_publisher(config: KVEventsConfig, data_parallel_rank: int = 0) -> EventPublisher:
    """The publisher `config` asks for: ZMQ when events are enabled, else the null one."""
    if not config.enabled:
        return NullEventPublisher()
    return ZmqEventPublisher(config, data_parallel_rank)

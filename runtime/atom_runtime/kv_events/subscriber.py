"""Reading one pod's KV events: SUB for the live stream, DEALER for replay, into a PrefixIndex.

Batches are applied strictly in sequence order. When the live stream skips numbers (a slow
subscriber, a late join, a restart of the connection), the missing batches are fetched from the
publisher's replay socket before the newer one is applied. What replay cannot return any more
(the ring moved on, or the publisher dropped it from its own queue) is counted as unfillable:
the index may then be stale, and the counters say so.

Sockets are created by the thread that first uses them: `poll()` from one thread, or `start()`,
which runs the poll loop in a background thread. Never both.
"""

from __future__ import annotations

import logging
import threading

import zmq

from atom_runtime.kv_events.config import parse_endpoint
from atom_runtime.kv_events.curve import CurveKeys
from atom_runtime.kv_events.events import EventBatch, KVEventDecodeError, decode_batch
from atom_runtime.kv_events.index import PrefixIndex

logger = logging.getLogger(__name__)

_END_OF_REPLAY = -1


class KVEventSubscriber:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        pod: str | None = None,
        index: PrefixIndex | None = None,
        *,
        bind: bool | None = None,
        replay_timeout_ms: int = 2000,
        rcvhwm: int | None = None,
        context: zmq.Context | None = None,
        curve: CurveKeys | None = None,
    ) -> None:
        """`bind=None` binds when the endpoint host is `*` (publishers connect to us), else connects.

        `pod` names this publisher in the index (default: the endpoint). `rcvhwm` bounds the
        messages queued for a slow reader (ZMQ's default 1000); beyond it ZMQ drops, and the
        drops come back through replay as a gap. `curve`: the router's CurveZMQ keys, for
        publishers that admit only them (kv_events/curve.py).
        """
        scheme, host, _ = parse_endpoint("endpoint", endpoint)
        if replay_endpoint is not None:
            parse_endpoint("replay_endpoint", replay_endpoint)
        if replay_timeout_ms <= 0:
            raise ValueError(f"replay_timeout_ms must be > 0, got {replay_timeout_ms}")
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.pod = pod if pod is not None else endpoint
        self.index = index if index is not None else PrefixIndex()
        self._bind = (scheme == "tcp" and host == "*") if bind is None else bind
        self._replay_timeout_ms = replay_timeout_ms
        self._rcvhwm = rcvhwm
        self._curve = curve
        self._ctx = context if context is not None else zmq.Context.instance()

        self.last_seq = -1  # the newest batch applied; -1 before the first
        self.batches_applied = 0
        self.duplicates_skipped = 0
        self.gaps_filled = 0  # gaps in the live stream closed completely by replay
        self.gaps_unfillable = 0  # runs of batches that could not be recovered
        self.batches_missed = 0  # how many batches those runs held
        self.malformed_total = 0  # messages that were not [topic, seq, batch]
        self.replay_failures = 0  # replay requests that got no complete answer in time

        self._sub: zmq.Socket | None = None
        self._dealer: zmq.Socket | None = None
        self._owner: threading.Thread | None = None
        self._needs_bootstrap = replay_endpoint is not None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._failure: BaseException | None = None

    # ---- sockets ---------------------------------------------------------------------------

    def _open(self) -> zmq.Socket:
        me = threading.current_thread()
        if self._owner is not None and self._owner is not me:
            raise RuntimeError("KVEventSubscriber sockets belong to another thread")
        if self._sub is None:
            self._owner = me
            sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            if self._rcvhwm is not None:
                sub.setsockopt(zmq.RCVHWM, self._rcvhwm)
            sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode("utf-8"))
            if self._curve is not None:
                self._curve.make_client(sub)
            if self._bind:
                sub.bind(self.endpoint)
            else:
                sub.connect(self.endpoint)
            self._sub = sub
        return self._sub

    def _open_dealer(self) -> zmq.Socket:
        if self._dealer is None:
            dealer = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            if self._curve is not None:
                self._curve.make_client(dealer)
            dealer.connect(self.replay_endpoint)
            self._dealer = dealer
        return self._dealer

    def close(self) -> None:
        """Close the sockets (poll mode); `stop()` does this for the background mode."""
        if self._thread is not None and self._thread is not threading.current_thread():
            self.stop()
            return
        for sock in (self._sub, self._dealer):
            if sock is not None:
                sock.close(linger=0)
        self._sub = self._dealer = None
        self._owner = None

    def __enter__(self) -> KVEventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- receiving -------------------------------------------------------------------------

    def poll(self, timeout_ms: int = 0) -> list[tuple[int, EventBatch]]:
        """Wait up to `timeout_ms` for events, apply everything available; returns what was applied.

        The first call connects and, with a replay endpoint, first fetches the history from seq 0.
        """
        if self._thread is not None and self._thread is not threading.current_thread():
            raise RuntimeError("poll() while the background thread runs; use one or the other")
        sub = self._open()
        applied: list[tuple[int, EventBatch]] = []
        if self._needs_bootstrap:
            self._needs_bootstrap = False
            self._catch_up(applied, start=0)
        if not sub.poll(timeout_ms):
            return applied
        while True:
            try:
                frames = sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return applied
            self._on_live(frames, applied)

    def _on_live(self, frames: list[bytes], applied: list[tuple[int, EventBatch]]) -> None:
        # Like llm-d: anything but [topic, 8-byte seq, payload] is not ours.
        if len(frames) != 3 or len(frames[1]) != 8:
            self.malformed_total += 1
            logger.warning("ignoring a %d-frame message on %s", len(frames), self.endpoint)
            return
        seq = int.from_bytes(frames[1], "big")
        if seq <= self.last_seq:
            self.duplicates_skipped += 1
            return
        if seq > self.last_seq + 1 and self.replay_endpoint is not None:
            before = self.gaps_unfillable
            self._catch_up(applied, start=self.last_seq + 1)
            if self.gaps_unfillable == before and self.last_seq >= seq - 1:
                self.gaps_filled += 1
            if seq <= self.last_seq:
                self.duplicates_skipped += 1
                return
        self._apply(seq, frames[2], applied)

    def _catch_up(self, applied: list[tuple[int, EventBatch]], start: int) -> None:
        """Ask the replay socket for every batch from `start` and apply them in order."""
        replies = self._replay(start)
        if replies is None:
            self.replay_failures += 1
            return
        for seq, payload in replies:
            if seq > self.last_seq:
                self._apply(seq, payload, applied)

    def _replay(self, start: int) -> list[tuple[int, bytes]] | None:
        dealer = self._open_dealer()
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        replies: list[tuple[int, bytes]] = []
        while dealer.poll(self._replay_timeout_ms):
            frames = dealer.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                self.malformed_total += 1
                continue
            seq = int.from_bytes(frames[1], "big", signed=True)
            if seq == _END_OF_REPLAY:
                return replies
            replies.append((seq, frames[2]))
        # No end marker in time: a late answer must not be mistaken for the next one's.
        logger.warning(
            "replay from %s timed out after %d replies", self.replay_endpoint, len(replies)
        )
        dealer.close(linger=0)
        self._dealer = None
        return None

    def _apply(self, seq: int, payload: bytes, applied: list[tuple[int, EventBatch]]) -> None:
        if seq > self.last_seq + 1:
            self.gaps_unfillable += 1
            self.batches_missed += seq - self.last_seq - 1
            logger.warning(
                "KV events %d..%d from %s are lost; the index may be stale",
                self.last_seq + 1,
                seq - 1,
                self.pod,
            )
        self.last_seq = seq
        try:
            batch = decode_batch(payload)
        except KVEventDecodeError as exc:
            self.malformed_total += 1
            logger.warning("undecodable KV event batch seq=%d from %s: %s", seq, self.pod, exc)
            return
        self.index.apply(self.pod, batch)
        self.batches_applied += 1
        applied.append((seq, batch))

    # ---- background mode -------------------------------------------------------------------

    def start(self) -> None:
        """Run the poll loop in a background thread until `stop()`."""
        if self._thread is not None:
            raise RuntimeError("already started")
        if self._owner is not None:
            raise RuntimeError("poll() already used this subscriber; use one mode or the other")
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._run, name=f"kv-events-subscriber-{self.pod}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.poll(100)
        except BaseException as exc:
            self._failure = exc
            logger.error("KV event subscriber for %s stopped: %r", self.pod, exc)
        finally:
            for sock in (self._sub, self._dealer):
                if sock is not None:
                    sock.close(linger=0)
            self._sub = self._dealer = None

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the background thread, close its sockets, and re-raise anything that killed it."""
        thread = self._thread
        if thread is None:
            return
        self._stop.set()
        thread.join(timeout)
        if thread.is_alive():
            raise RuntimeError(f"KV event subscriber thread did not stop within {timeout}s")
        self._thread = None
        self._owner = None
        self.raise_if_failed()

    def raise_if_failed(self) -> None:
        if self._failure is not None:
            raise RuntimeError(f"KV event subscriber failed: {self._failure!r}") from self._failure

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

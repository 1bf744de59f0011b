"""The portable transport's control messages (protocol 3) and their seal.

Control travels as msgspec msgpack structs over ZMQ (never pickle): `Pull` (consumer -> producer)
asks for held blocks, `PullReply` grants a ticket for the payload port or names an error,
`Release` ends a hold, and `Stripe` is the one message on a payload connection (which stripe it
carries). With the deployment's transfer key (kv_transfer/auth.py) every message carries an
HMAC-SHA256 over its msgpack encoding (the `mac` field left empty), under a label of its own
type. A Pull or Release also carries the sender's clock and a random nonce: the producer takes it
only within MAX_SKEW_S of its own clock and only once (a captured pull cannot be replayed). A
reply echoes its pull's nonce, so a consumer takes no answer to a pull it did not send.

Without a key (`insecure: true`) nothing is sealed or checked, and a keyed peer refuses such
messages by name.
"""

from __future__ import annotations

import secrets
import time

import msgspec

from atom_runtime.kv_transfer.auth import TransferKey

PROTOCOL = 4  # 3: whole blocks only; 2: control unauthenticated; 1: the payload was a second
# frame of the PullReply
MAX_SKEW_S = 30.0  # how far a Pull's or Release's clock may be from the producer's
NONCE_BYTES = 16
MAX_NONCES = 1 << 16  # nonces remembered at once (each for 2 * MAX_SKEW_S)
UNAUTHENTICATED = (
    "not authenticated with the deployment's KV-transfer key (do both engines read the same "
    "ATOM_TRANSFER_KEY_FILE / ATOM_TRANSFER_KEY?)"
)


class Pull(msgspec.Struct, tag=True):
    transfer_id: str
    block_ids: list[int]
    layout: str
    version: int = 1  # a protocol-1 consumer sends no version
    streams: int = 1
    timeout_s: float = 30.0  # how long the consumer will wait: the ticket's lifetime
    ts: float = 0.0  # the consumer's time.time() when it sent this
    nonce: bytes = b""
    mac: bytes = b""
    heads: tuple[int, int] | None = None  # KV heads [first, end) of the producer's; None: all


class PullReply(msgspec.Struct, tag=True):
    transfer_id: str
    error: str | None = None  # None: the payload waits on data_port under `ticket`
    data_port: int = 0  # 0 from a protocol-1 producer, whose payload frame follows instead
    ticket: str = ""
    stripes: int = 0
    nbytes: int = 0
    nonce: bytes = b""  # the Pull's, echoed
    mac: bytes = b""


class Release(msgspec.Struct, tag=True):
    transfer_id: str
    ts: float = 0.0
    nonce: bytes = b""
    mac: bytes = b""


class Stripe(msgspec.Struct, tag=True):
    """The first (and only) message on a payload connection: which stripe it carries."""

    ticket: str
    index: int
    mac: bytes = b""


WIRE = Pull | PullReply | Release
_LABELS = {
    Pull: b"atom-kv-pull/3",
    PullReply: b"atom-kv-pull-reply/3",
    Release: b"atom-kv-release/3",
    Stripe: b"atom-kv-stripe/3",
}


class WireSeal:
    """Seals outgoing control messages and checks incoming ones with the transfer key (None:
    insecure, nothing sealed or checked). The nonce memory belongs to one thread.

    `labels`: the MAC label of each message type (another transport's messages: a MAC made for
    one type is never valid for another); `stamped`: the types that carry a clock and a nonce
    (requests a producer acts on), checked for freshness and replay."""

    def __init__(
        self,
        key: TransferKey | None,
        labels: dict[type, bytes] | None = None,
        stamped: tuple[type, ...] = (Pull, Release),
    ) -> None:
        self.key = key
        self._labels = labels or _LABELS
        self._stamped = stamped
        self._encoder = msgspec.msgpack.Encoder()
        self._seen: dict[bytes, float] = {}  # nonce -> when it may be forgotten

    def seal(self, msg: msgspec.Struct) -> msgspec.Struct:
        """Stamp a request with the clock and a fresh nonce, then MAC any message."""
        if isinstance(msg, self._stamped):
            msg.ts = time.time()
            msg.nonce = secrets.token_bytes(NONCE_BYTES)
        if self.key is not None:
            msg.mac = self._mac(msg)
        return msg

    def check(self, msg: msgspec.Struct, now: float | None = None) -> str | None:
        """Why `msg` must not be acted on, or None when it may."""
        if self.key is None:
            return None
        if not msg.mac or not self.key.verify(msg.mac, self._labels[type(msg)], self._body(msg)):
            return UNAUTHENTICATED
        if not isinstance(msg, self._stamped):
            return None
        now = time.time() if now is None else now
        if not abs(now - msg.ts) <= MAX_SKEW_S:
            return (
                f"sent {now - msg.ts:+.0f} s from this producer's clock (more than "
                f"{MAX_SKEW_S:g} s apart: keep the pods' clocks in step)"
            )
        return self._first_use(msg.nonce, now)

    def _first_use(self, nonce: bytes, now: float) -> str | None:
        if len(nonce) != NONCE_BYTES:
            return "a message without its nonce"
        if nonce in self._seen:
            return "a replayed message (its nonce was used already)"
        if len(self._seen) >= MAX_NONCES:
            self._seen = {n: t for n, t in self._seen.items() if t > now}
            if len(self._seen) >= MAX_NONCES:
                return f"more than {MAX_NONCES} control messages within {2 * MAX_SKEW_S:g} s"
        self._seen[nonce] = now + 2 * MAX_SKEW_S
        return None

    def _body(self, msg: msgspec.Struct) -> bytes:
        return self._encoder.encode(msgspec.structs.replace(msg, mac=b""))

    def _mac(self, msg: msgspec.Struct) -> bytes:
        return self.key.mac(self._labels[type(msg)], self._body(msg))

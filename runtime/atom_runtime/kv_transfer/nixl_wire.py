"""The NIXL connector's control messages, sealed like the portable transport's (wire.py).

Control travels as msgspec msgpack over ZMQ on each producer rank's control port (never pickle):
`NixlPull` (consumer -> producer) asks to read held blocks and names the consumer's NIXL agent;
`NixlGrant` answers with an error or with what a read needs: the producer rank's agent name and
metadata (loaded once per agent), its cache geometry (nixl_descs.CacheGeometry) and a ticket;
`Release` (wire.py's) ends a hold. With the deployment's transfer key every message carries an
HMAC-SHA256 under a label of its own type; a NixlPull or Release also carries the sender's clock
and a nonce, taken once within MAX_SKEW_S, and a grant echoes its pull's nonce.

The read itself is one-sided (UCX moves the bytes; the producer's CPU is not involved). When it
completes, NIXL delivers the consumer's notification to the producer: `done_note`, the ticket
with a MAC, so a forged note cannot end a read early. Until that note, a Release of the transfer
or the pull's timeout, the producer counts the blocks as being read.
"""

from __future__ import annotations

import msgspec

from atom_runtime.kv_transfer.auth import TransferKey
from atom_runtime.kv_transfer.wire import Release, WireSeal

PROTOCOL = 1
NOTE_PREFIX = b"atom-kv-read-done:"
_NOTE_LABEL = b"atom-kv-nixl-note/1"
MAX_GRANT_BYTES = 4 << 20  # a grant carries the agent's metadata (tens of KiB for many tensors)


class NixlPull(msgspec.Struct, tag=True):
    transfer_id: str
    block_ids: list[int]
    layout: str
    version: int = PROTOCOL
    timeout_s: float = 30.0  # how long the consumer will wait: the ticket's lifetime
    heads: tuple[int, int] | None = None  # KV heads [first, end) of the producer rank's
    agent: str = ""  # the consumer's NIXL agent (its read's note comes from it)
    agent_has: str = ""  # the producer agent whose metadata the consumer loaded already
    ts: float = 0.0
    nonce: bytes = b""
    mac: bytes = b""


class NixlGrant(msgspec.Struct, tag=True):
    transfer_id: str
    error: str | None = None
    agent: str = ""  # the producer rank's NIXL agent
    metadata: bytes = b""  # its agent metadata (nixl_agent.get_agent_metadata)
    regions: list[int] = []  # CacheGeometry fields
    device: int = 0
    memory: str = ""
    block_bytes: int = 0
    row_bytes: int = 0
    head_bytes: int = 0
    block_size: int = 0
    ticket: str = ""
    nonce: bytes = b""  # the pull's, echoed
    mac: bytes = b""


NIXL_WIRE = NixlPull | NixlGrant | Release
_LABELS = {
    NixlPull: b"atom-kv-nixl-pull/1",
    NixlGrant: b"atom-kv-nixl-grant/1",
    Release: b"atom-kv-release/3",
}


def nixl_seal(key: TransferKey | None) -> WireSeal:
    return WireSeal(key, _LABELS, (NixlPull, Release))


def done_note(key: TransferKey | None, ticket: str) -> bytes:
    """The notification a finished read carries to the producer."""
    body = ticket.encode()
    mac = key.mac(_NOTE_LABEL, body).hex().encode() if key is not None else b""
    return NOTE_PREFIX + body + b":" + mac


def read_note(key: TransferKey | None, note: bytes) -> str | None:
    """The ticket a notification names, or None when it is not one of ours or not genuine."""
    if not note.startswith(NOTE_PREFIX):
        return None
    body, _, mac = note[len(NOTE_PREFIX) :].partition(b":")
    if key is not None:
        try:
            ok = key.verify(bytes.fromhex(mac.decode()), _NOTE_LABEL, body)
        except ValueError:
            ok = False
        if not ok:
            return None
    try:
        return body.decode()
    except UnicodeDecodeError:
        return None

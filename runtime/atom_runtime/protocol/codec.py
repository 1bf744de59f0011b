"""The msgspec msgpack codec of every message in this package (never pickle): numpy arrays
travel as (dtype, shape, bytes). Use `encoder()` / `decoder(kind)` on every socket."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np


def _encode_custom(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        a = np.ascontiguousarray(obj)
        return (a.dtype.str, a.shape, a.data)  # e.g. ("<i8", (3,), raw bytes)
    raise NotImplementedError(f"cannot put a {type(obj).__name__} on the wire")


def _decode_custom(kind: type, obj: Any) -> Any:
    if kind is np.ndarray:
        dtype, shape, data = obj
        # Writable, so torch.from_numpy takes the array without a warning.
        return np.frombuffer(bytearray(data), dtype=np.dtype(dtype)).reshape(shape)
    raise NotImplementedError(f"cannot read a {kind.__name__} from the wire")


def encoder() -> msgspec.msgpack.Encoder:
    """The encoder of every message in this package."""
    return msgspec.msgpack.Encoder(enc_hook=_encode_custom)


def decoder(kind: Any) -> msgspec.msgpack.Decoder:
    """A decoder of `kind` (one of the unions `ClientMessage`, `EngineMessage`, `ToWorker`, `FromWorker`)."""
    return msgspec.msgpack.Decoder(kind, dec_hook=_decode_custom)


def receive_waiting(sock, decoder: msgspec.msgpack.Decoder) -> Iterator[Any]:
    """Decode every message already waiting on a ZMQ socket, never waiting for one."""
    import zmq

    while True:
        try:
            frame = sock.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return
        yield decoder.decode(frame.buffer)

"""CurveZMQ for the KV-event sockets: encryption, and admission of one client key only.

A key directory holds four Z85 text files (40 characters each), made by `atom kv-events keygen
DIR` or any `zmq.curve_keypair()`:

    kv-events-server.key  kv-events-server.pub   the engines' keypair (PUB and replay sockets)
    kv-events-client.key  kv-events-client.pub   the router's keypair (SUB and replay DEALER)

The publisher is a CURVE server with the server keypair and admits, through a ZAP authenticator
(pyzmq's ThreadAuthenticator, on the publisher's own ZMQ context), only the client public key; the
subscriber is a CURVE client that knows the server's public key. Without the client secret key a
peer completes no handshake, so it reads no event; without the server's, it cannot pose as an
engine. Engines need the server pair and the client public key; the router needs the client pair
and the server public key (the other files may be absent where they are not needed).
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.utils import z85

SERVER_SECRET = "kv-events-server.key"
SERVER_PUBLIC = "kv-events-server.pub"
CLIENT_SECRET = "kv-events-client.key"
CLIENT_PUBLIC = "kv-events-client.pub"


@dataclass(frozen=True)
class CurveKeys:
    """Z85 keys read from a key directory (None where the file is not needed by this side)."""

    server_public: bytes
    server_secret: bytes | None = None
    client_public: bytes | None = None
    client_secret: bytes | None = None

    @classmethod
    def for_publisher(cls, directory: str, field: str) -> CurveKeys:
        """The PUB side's: its own pair and the one client key it admits."""
        names = (SERVER_PUBLIC, SERVER_SECRET, CLIENT_PUBLIC)
        public, secret, client = (read_key(directory, n, field) for n in names)
        return cls(server_public=public, server_secret=secret, client_public=client)

    @classmethod
    def for_subscriber(cls, directory: str, field: str) -> CurveKeys:
        """The SUB side's: the server's public key and its own pair."""
        names = (SERVER_PUBLIC, CLIENT_PUBLIC, CLIENT_SECRET)
        server, public, secret = (read_key(directory, n, field) for n in names)
        return cls(server_public=server, client_public=public, client_secret=secret)

    def make_server(self, sock: zmq.Socket) -> None:
        """Make `sock` a CURVE server (before it binds)."""
        sock.curve_secretkey = self.server_secret
        sock.curve_publickey = self.server_public
        sock.curve_server = True

    def make_client(self, sock: zmq.Socket) -> None:
        """Make `sock` a CURVE client of the engines' server key (before it connects)."""
        sock.curve_secretkey = self.client_secret
        sock.curve_publickey = self.client_public
        sock.curve_serverkey = self.server_public


def read_key(directory: str, name: str, field: str) -> bytes:
    """One Z85 key file; ValueError naming `field` and the file when it is missing or bad."""
    path = Path(directory) / name
    try:
        text = path.read_text().strip()
    except OSError as e:
        raise ValueError(f"{field}: cannot read {path} ({e.strerror})") from None
    try:
        ok = len(text) == 40 and len(z85.decode(text)) == 32
    except (ValueError, KeyError, IndexError):
        ok = False
    if not ok:
        raise ValueError(f"{field}: {path} is not a Z85 CURVE key (40 characters)")
    return text.encode("ascii")


def write_keys(directory: str) -> None:
    """Make a fresh server and client keypair in `directory` (secret files mode 0600)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    for public_name, secret_name in (
        (SERVER_PUBLIC, SERVER_SECRET),
        (CLIENT_PUBLIC, CLIENT_SECRET),
    ):
        public, secret = zmq.curve_keypair()
        (out / public_name).write_text(public.decode() + "\n")
        path = out / secret_name
        path.touch(mode=0o600)
        path.write_text(secret.decode() + "\n")


class OneClient:
    """A ZAP credentials provider admitting exactly one CURVE client public key."""

    def __init__(self, client_public: bytes) -> None:
        self.client_public = client_public

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(key, self.client_public)


def start_authenticator(context: zmq.Context, client_public: bytes):
    """A running ZAP authenticator on `context` that admits only `client_public`."""
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(context)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=OneClient(client_public))
    return auth

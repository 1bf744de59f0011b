"""The listening side both HTTP servers share (`atom serve`'s API server and `atom router`): a
socket bound before uvicorn starts, so a taken port is one clear line, and uvicorn's settings for
a server whose logging is the process's own."""

from __future__ import annotations

import socket
from typing import Any


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (IPv6 for an IPv6 literal), with SO_REUSEADDR, for
    uvicorn to serve on. OSError, the socket closed, when it cannot bind."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def uvicorn_config(app: Any, log_level: str, **settings: Any):
    """uvicorn's configuration for `app`: the process's logging (no log config or access log
    of uvicorn's own) and the app's lifespan run; `settings` adds to it."""
    import uvicorn

    return uvicorn.Config(
        app, log_level=log_level, log_config=None, access_log=False, lifespan="on", **settings
    )

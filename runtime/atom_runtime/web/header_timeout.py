"""uvicorn's HTTP protocol with a deadline on request headers.

uvicorn times out idle keep-alive connections, but not a client that sends its request line and
headers a byte at a time: each byte re-arms nothing and the connection (and its buffer) is held
for as long as the client likes. Here a connection's headers must be whole within `timeout`
seconds of the connection opening, or of the previous response ending; otherwise it is closed.
Pass `header_timeout_protocol(seconds)` as uvicorn.Config(http=...).
"""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger(__name__)


class _HeaderDeadline:
    """Mixed in before a uvicorn HTTP protocol class (h11 or httptools): both set `self.cycle`
    when a request's headers are complete and call `on_response_complete` after its answer."""

    header_timeout: float = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:
        self._header_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        cycle = self.cycle
        super().data_received(data)
        if self.cycle is not None and self.cycle is not cycle:  # a request's headers are whole
            self._disarm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        idle = self.cycle is None or self.cycle.response_complete
        if idle and not self.transport.is_closing():  # waiting for the next request's headers
            self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_late)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_late(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            log.debug(
                "closing a connection whose request headers took over %gs", self.header_timeout
            )
            self.transport.close()


def header_timeout_protocol(timeout: float) -> type[asyncio.Protocol]:
    """uvicorn's own HTTP protocol class (httptools when installed, else h11) with the deadline."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    return type(
        "HeaderTimeoutProtocol",
        (_HeaderDeadline, AutoHTTPProtocol),
        {"header_timeout": timeout},
    )

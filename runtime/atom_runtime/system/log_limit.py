"""A log line that a flood cannot multiply: what a peer (a client, a port scanner, a garbage
sender) can trigger at will is logged at most once per interval, the next line saying how many
were held back."""

from __future__ import annotations

import logging
import threading
import time


class RateLimitedLog:
    """`log(message, *args)` logs at `level` at most once per `interval` seconds; the lines in
    between are counted and the count is added to the next one that is logged."""

    def __init__(self, logger: logging.Logger, interval: float, level: int = logging.WARNING):
        self.logger, self.interval, self.level = logger, interval, level
        self._last: float | None = None
        self._held = 0
        self._lock = threading.Lock()

    def __call__(self, message: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            if self._last is not None and now - self._last < self.interval:
                self._held += 1
                return
            held, self._held, self._last = self._held, 0, now
        if held:
            message += " (%d more like it since the last one)"
            args = (*args, held)
        self.logger.log(self.level, message, *args)

"""The router's view of its engines: who is there, who is healthy, how loaded, what they cache.

A `Backend` is one `atom serve` pod of one role (decode or prefill). The `BackendPool` holds them,
keyed by base URL, and is changed only from the router's event loop: discovery hands it the full
set of URLs for a role (`set_role_urls`), the prober marks backends healthy or not after each
`/health` + `/metrics` scrape, and the proxy ejects a backend the moment a request to it fails.

Decode backends feed a shared `PrefixIndex` through one `KVEventSubscriber` each (a background
thread), so the scorer can ask how many leading blocks of a prompt each pod holds. A pod is
subscribed to once it first answers its health probe: an engine still loading has no KV-event
sockets yet, and asking its replay socket then would only time out.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

from atom_runtime.kv_events import KVEventSubscriber, PrefixIndex
from atom_runtime.kv_events.curve import CurveKeys

log = logging.getLogger(__name__)

ROLES = ("decode", "prefill")


@dataclass(frozen=True)
class BackendAddress:
    """Where one engine listens: its HTTP base URL and, for decode pods, its KV-event sockets."""

    url: str
    kv_events: str | None = None  # tcp://host:port of the PUB socket
    kv_replay: str | None = None  # tcp://host:port of the replay ROUTER socket

    @classmethod
    def parse(cls, text: str, kv_events_port: int | None, kv_replay_port: int | None):
        """`URL[,kv-events=PORT][,kv-replay=PORT]`; the ports default to the router-wide flags.

        A port of 0 (or no port at all) means the pod publishes no KV events."""
        url, *opts = [part.strip() for part in text.split(",")]
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"backend: {url!r} is not an http(s)://host[:port] URL")
        for opt in opts:
            key, sep, value = opt.partition("=")
            if not sep or key not in ("kv-events", "kv-replay") or not value.isdigit():
                raise ValueError(
                    f"backend: option {opt!r} of {text!r} is not kv-events=PORT or kv-replay=PORT"
                )
            if key == "kv-events":
                kv_events_port = int(value)
            else:
                kv_replay_port = int(value)
        return cls.for_host(url.rstrip("/"), parts.hostname, kv_events_port, kv_replay_port)

    @classmethod
    def for_host(
        cls, url: str, host: str, kv_events_port: int | None, kv_replay_port: int | None
    ) -> BackendAddress:
        host = f"[{host}]" if ":" in host else host
        events = f"tcp://{host}:{kv_events_port}" if kv_events_port else None
        replay = f"tcp://{host}:{kv_replay_port}" if kv_replay_port and events else None
        return cls(url, events, replay)


@dataclass
class Backend:
    address: BackendAddress
    role: str
    healthy: bool = False  # admitted: answered /health with 200 since it was last ejected
    ejected_reason: str | None = None
    # From the latest /metrics scrape.
    requests_running: float = 0.0
    requests_waiting: float = 0.0
    kv_cache_usage: float = 0.0
    block_size: int | None = None
    # Requests this router has outstanding to it: a load signal fresher than the scrape.
    in_flight: int = 0
    subscriber: KVEventSubscriber | None = field(default=None, repr=False)
    last_probe: float = 0.0

    @property
    def url(self) -> str:
        return self.address.url

    @property
    def load(self) -> float:
        """Requests queued or running on the pod, as best we know."""
        return max(self.requests_running + self.requests_waiting, float(self.in_flight))


def parse_engine_metrics(text: str) -> dict[str, float | int]:
    """The load numbers the scorer uses, out of an `atom serve` /metrics page."""
    out: dict[str, float | int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "atom:requests_running":
                out["requests_running"] = sample.value
            elif sample.name == "atom:requests_waiting":
                out["requests_waiting"] = sample.value
            elif sample.name == "atom:kv_cache_usage_ratio":
                out["kv_cache_usage"] = sample.value
            elif sample.name == "atom:cache_config_info" and "block_size" in sample.labels:
                out["block_size"] = int(sample.labels["block_size"])
    return out


class BackendPool:
    """Every known backend by role; readiness waiters; the prefix index of the decode pods."""

    def __init__(self, *, subscribe_kv_events: bool = True, curve: CurveKeys | None = None):
        self.backends: dict[str, dict[str, Backend]] = {role: {} for role in ROLES}
        self.index = PrefixIndex()
        self.subscribe_kv_events = subscribe_kv_events
        self.curve = curve  # the router's CurveZMQ keys for the pods' KV-event sockets
        self._ready_changed: dict[str, asyncio.Event] = {role: asyncio.Event() for role in ROLES}
        self.on_eject: Callable[[str], None] | None = None  # called with the role

    # -- membership ------------------------------------------------------------------------------

    def set_role_addresses(self, role: str, addresses: Sequence[BackendAddress]) -> None:
        """Discovery's full answer for `role`: add the new, forget the gone."""
        current = self.backends[role]
        wanted = {a.url: a for a in addresses}
        for url in [u for u in current if u not in wanted]:
            self._forget(current.pop(url))
            log.info("%s backend %s left", role, url)
        for url, address in wanted.items():
            known = current.get(url)
            if known is not None and known.address == address:
                continue
            if known is not None:
                self._forget(known)
            current[url] = Backend(address, role)
            log.info("%s backend %s joined (waiting for its first health probe)", role, url)
        self._ready_changed[role].set()

    def _subscribe(self, backend: Backend) -> None:
        address = backend.address
        if backend.role != "decode" or not self.subscribe_kv_events or address.kv_events is None:
            return
        sub = KVEventSubscriber(
            address.kv_events,
            address.kv_replay,
            pod=backend.url,
            index=self.index,
            curve=self.curve,
        )
        sub.start()
        backend.subscriber = sub

    def _is_member(self, backend: Backend) -> bool:
        return self.backends[backend.role].get(backend.url) is backend

    def _forget(self, backend: Backend) -> None:
        if backend.subscriber is not None:
            try:
                backend.subscriber.stop()
            except RuntimeError as e:
                log.warning("KV event subscriber of %s: %s", backend.url, e)
            backend.subscriber = None
        self.index.remove_pod(backend.url)

    def close(self) -> None:
        for role in ROLES:
            for backend in self.backends[role].values():
                self._forget(backend)
            self.backends[role].clear()

    # -- health ----------------------------------------------------------------------------------

    def ready(self, role: str) -> list[Backend]:
        return [b for b in self.backends[role].values() if b.healthy]

    def eject(self, backend: Backend, reason: str) -> None:
        """Take a backend out of rotation until a health probe re-admits it."""
        if backend.healthy:
            if self.on_eject is not None:
                self.on_eject(backend.role)
            log.warning("ejecting %s backend %s: %s", backend.role, backend.url, reason)
        backend.healthy = False
        backend.ejected_reason = reason

    def admit(self, backend: Backend) -> None:
        if not backend.healthy:
            log.info("%s backend %s is healthy", backend.role, backend.url)
        if backend.subscriber is None and self._is_member(backend):
            self._subscribe(backend)
        backend.healthy = True
        backend.ejected_reason = None
        self._ready_changed[backend.role].set()

    async def wait_ready(self, role: str, timeout: float) -> bool:
        """Wait up to `timeout` seconds for a ready backend of `role`; True when there is one."""
        deadline = time.monotonic() + timeout
        while not self.ready(role):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            event = self._ready_changed[role]
            event.clear()
            try:
                await asyncio.wait_for(event.wait(), left)
            except TimeoutError:
                return bool(self.ready(role))
        return True

    async def probe(self, client: httpx.AsyncClient, backend: Backend, timeout: float) -> None:
        """/health decides admission; /metrics refreshes load and block size (logged at DEBUG:
        they come every --probe-interval)."""
        backend.last_probe = time.monotonic()
        log.debug("probing %s backend %s", backend.role, backend.url)
        try:
            health = await client.get(f"{backend.url}/health", timeout=timeout)
            if health.status_code != 200:
                self.eject(backend, f"/health answered {health.status_code}")
                return
            metrics = await client.get(f"{backend.url}/metrics", timeout=timeout)
            metrics.raise_for_status()
        except httpx.HTTPError as e:
            self.eject(backend, f"probe failed: {type(e).__name__}: {e}")
            return
        try:
            numbers = parse_engine_metrics(metrics.text)
        except ValueError as e:
            self.eject(backend, f"unreadable /metrics: {e}")
            return
        for name, value in numbers.items():
            setattr(backend, name, value)
        self.admit(backend)

    async def probe_all(self, client: httpx.AsyncClient, timeout: float) -> None:
        backends = [b for role in ROLES for b in self.backends[role].values()]
        await asyncio.gather(*(self.probe(client, b, timeout) for b in backends))

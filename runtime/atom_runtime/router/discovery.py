"""Where the engines are: static URLs, a Kubernetes Service's EndpointSlices, or its DNS records.

The operator renders `--decode-service http://<svc>.<ns>.svc.cluster.local:8000` (a headless
Service per role). Inside a cluster the router watches that Service's EndpointSlices through the
API server (`kubernetes.io/service-name=<svc>`), so a pod joins the rotation when it turns ready and
leaves it the moment it stops being ready. Without API access (no in-cluster credentials, or RBAC
refusing the watch) it falls back to resolving the headless Service's DNS name, which lists the
ready pods' IPs too, every `interval` seconds.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from atom_runtime.router.backends import BackendAddress

log = logging.getLogger(__name__)

# <service>.<namespace>.svc[.<cluster domain>]
_SERVICE_HOST = re.compile(
    r"^(?P<svc>[a-z0-9]([-a-z0-9]*[a-z0-9])?)\.(?P<ns>[a-z0-9-]+)\.svc(\..+)?$"
)


@dataclass(frozen=True)
class ServiceTarget:
    """A `--decode-service`/`--prefill-service` URL, split into what discovery needs."""

    scheme: str
    host: str
    port: int
    service: str | None  # the Kubernetes Service name, when the host is a cluster DNS name
    namespace: str | None

    @classmethod
    def parse(cls, url: str) -> ServiceTarget:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"service: {url!r} is not an http(s)://host[:port] URL")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        m = _SERVICE_HOST.match(parts.hostname)
        return cls(
            parts.scheme,
            parts.hostname,
            port,
            m["svc"] if m else None,
            m["ns"] if m else None,
        )


def addresses_from_slices(
    slices: Iterable[dict[str, Any]],
    target: ServiceTarget,
    kv_events_port: int | None,
    kv_replay_port: int | None,
) -> list[BackendAddress]:
    """The ready endpoints of a Service's EndpointSlices (API-server JSON), one address each.

    The HTTP port is the slice's port named `http` when it has one (the operator names it so),
    else the URL's. An endpoint counts unless its `ready` condition is explicitly false, as
    Kubernetes specifies for consumers (unknown means ready); terminating endpoints are not
    ready. Sorted by URL, no duplicates (an endpoint may appear in two slices while they move)."""
    out: dict[str, BackendAddress] = {}
    for sl in slices:
        if sl.get("addressType", "IPv4") not in ("IPv4", "IPv6"):
            continue  # FQDN slices name no pod
        port = target.port
        for p in sl.get("ports") or []:
            if p.get("name") == "http" and p.get("port"):
                port = int(p["port"])
        for ep in sl.get("endpoints") or []:
            conditions = ep.get("conditions") or {}
            if conditions.get("ready") is False:
                continue
            for ip in ep.get("addresses") or []:
                host = f"[{ip}]" if ":" in ip else ip
                url = f"{target.scheme}://{host}:{port}"
                out[url] = BackendAddress.for_host(url, ip, kv_events_port, kv_replay_port)
    return [out[url] for url in sorted(out)]


class EndpointSliceWatch:
    """Watch one Service's EndpointSlices from a thread; report every change as the full set.

    `on_change(addresses)` is called from the watch thread; the caller hops to its loop."""

    def __init__(
        self,
        target: ServiceTarget,
        on_change: Callable[[list[BackendAddress]], None],
        kv_events_port: int | None,
        kv_replay_port: int | None,
        api_client: Any = None,
        retry_s: float = 2.0,
    ) -> None:
        if target.service is None or target.namespace is None:
            raise ValueError(f"{target.host} is not a <service>.<namespace>.svc name")
        self.target = target
        self.on_change = on_change
        # Every pod found gets its KV-event and replay sockets at these ports (None or 0: none).
        self.kv_events_port, self.kv_replay_port = kv_events_port, kv_replay_port
        self.api_client = api_client
        self.retry_s = retry_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watch: Any = None
        self.failure: BaseException | None = None  # set when the API refused us for good

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name=f"endpointslices-{self.target.service}", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        from kubernetes import client, watch
        from kubernetes.client.rest import ApiException

        api_client = self.api_client or client.ApiClient()
        api = client.DiscoveryV1Api(api_client)
        selector = f"kubernetes.io/service-name={self.target.service}"
        slices: dict[str, dict[str, Any]] = {}
        while not self._stop.is_set():
            try:
                listed = api.list_namespaced_endpoint_slice(
                    self.target.namespace, label_selector=selector
                )
                slices = {
                    item.metadata.name: api_client.sanitize_for_serialization(item)
                    for item in listed.items
                }
                self._report(slices)
                self._watch = watch.Watch()
                for event in self._watch.stream(
                    api.list_namespaced_endpoint_slice,
                    self.target.namespace,
                    label_selector=selector,
                    resource_version=listed.metadata.resource_version,
                    timeout_seconds=300,
                ):
                    if self._stop.is_set():
                        return
                    obj = api_client.sanitize_for_serialization(event["object"])
                    name = (obj.get("metadata") or {}).get("name")
                    if event["type"] == "DELETED":
                        slices.pop(name, None)
                    elif event["type"] in ("ADDED", "MODIFIED"):
                        slices[name] = obj
                    else:
                        continue
                    self._report(slices)
            except ApiException as e:
                if e.status in (401, 403):
                    self.failure = e
                    log.warning(
                        "EndpointSlice watch of %s/%s refused (%s); falling back to DNS",
                        self.target.namespace,
                        self.target.service,
                        e.status,
                    )
                    return
                log.warning("EndpointSlice watch of %s: %s; retrying", self.target.service, e)
            except Exception as e:  # the API server went away: reconnect
                log.warning("EndpointSlice watch of %s: %r; retrying", self.target.service, e)
            self._stop.wait(self.retry_s)

    def _report(self, slices: dict[str, dict[str, Any]]) -> None:
        self.on_change(
            addresses_from_slices(
                slices.values(), self.target, self.kv_events_port, self.kv_replay_port
            )
        )


async def resolve_dns(
    target: ServiceTarget, kv_events_port: int | None, kv_replay_port: int | None
) -> list[BackendAddress]:
    """One address per IP the name resolves to (a headless Service: one per ready pod)."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        log.warning("cannot resolve %s: %s", target.host, e)
        return []
    out: dict[str, BackendAddress] = {}
    for _family, _type, _proto, _name, sockaddr in infos:
        ip = sockaddr[0]
        host = f"[{ip}]" if ":" in ip else ip
        url = f"{target.scheme}://{host}:{target.port}"
        out[url] = BackendAddress.for_host(url, ip, kv_events_port, kv_replay_port)
    return [out[url] for url in sorted(out)]


def in_cluster_config_loaded() -> bool:
    """Load the pod's service-account credentials; False outside a cluster."""
    from kubernetes import config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        return False
    return True

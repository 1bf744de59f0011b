"""Reading the pods' `/metrics` for the built-in autoscaler: which pods to ask, where, and what
their answers mean (`autoscale.parse_*`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import aiohttp

from atom_operator import autoscale
from atom_operator.schema import ENGINE_HTTP_PORT


def pod_is_ready(pod: Mapping) -> bool:
    """Running, Ready, with an IP, and not being deleted."""
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    state = pod.get("status") or {}
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in state.get("conditions") or []
    )
    return ready and bool(state.get("podIP"))


def metrics_url(pod: Mapping) -> str:
    """http://<pod IP>:<port>/metrics, the port being the container port named `http` (the
    engine's and the router's), so a pod says itself where its metrics are."""
    ip = pod["status"]["podIP"]
    host = f"[{ip}]" if ":" in ip else ip
    port = ENGINE_HTTP_PORT
    for container in (pod.get("spec") or {}).get("containers") or []:
        for entry in container.get("ports") or []:
            if entry.get("name") == "http" and entry.get("containerPort"):
                port = int(entry["containerPort"])
                break
        else:
            continue
        break
    return f"http://{host}:{port}/metrics"


async def _scrape(session: aiohttp.ClientSession, pod: Mapping) -> str:
    async with session.get(metrics_url(pod)) as response:
        if response.status != 200:
            raise autoscale.MetricsError(f"/metrics answered {response.status}")
        return await response.text()


async def scrape_engine(session: aiohttp.ClientSession, pod: Mapping) -> autoscale.PodMetrics:
    """One engine pod's metrics; a failed or unusable scrape is a PodMetrics with `error`."""
    name = pod["metadata"]["name"]
    try:
        return autoscale.parse_engine_metrics(name, await _scrape(session, pod))
    except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError, autoscale.MetricsError) as exc:
        return autoscale.PodMetrics(pod=name, error=f"{type(exc).__name__}: {exc}"[:200])


async def scrape_router_demand(
    session: aiohttp.ClientSession, pods: Iterable[Mapping]
) -> dict[str, float] | None:
    """role -> requests queued at the router pods; None when no router pod answered."""
    total: dict[str, float] | None = None
    for pod in pods:
        try:
            queued = autoscale.parse_router_queue(await _scrape(session, pod))
        except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError, autoscale.MetricsError):
            continue
        total = total or {}
        for role, value in queued.items():
            total[role] = total.get(role, 0.0) + value
    return total

"""The router's Prometheus metrics (contract 8: `atom:` prefix, counters end `_total`).

`atom:router_queued_requests{role}` and `atom:router_demand_total{role}` are a contract with the
operator, which scales a role up from zero replicas while the gauge is above zero; keep the names.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from atom_runtime.router.backends import ROLES, BackendPool
from atom_runtime.web.metrics import metrics_registry, render

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
                    80.0, 160.0)  # fmt: skip


class _BackendCollector(Collector):
    def __init__(self, pool: BackendPool) -> None:
        self.pool = pool

    def collect(self):
        state = GaugeMetricFamily(
            "atom:router_backend_healthy",
            "1 while the backend is in rotation, 0 while ejected or not yet probed.",
            labels=["role", "backend"],
        )
        load = GaugeMetricFamily(
            "atom:router_backend_in_flight",
            "Requests this router has outstanding to the backend.",
            labels=["role", "backend"],
        )
        for role in ROLES:
            for b in list(self.pool.backends[role].values()):
                state.add_metric([role, b.url], 1.0 if b.healthy else 0.0)
                load.add_metric([role, b.url], b.in_flight)
        yield state
        yield load


class RouterMetrics:
    def __init__(self, pool: BackendPool) -> None:
        self.registry = r = metrics_registry(_BackendCollector(pool))
        self.requests = Counter(
            "atom:router_requests",
            "Requests answered by the router, by route and HTTP status.",
            ["route", "code"],
            registry=r,
        )
        self.decisions = Counter(
            "atom:router_decisions",
            "Routing decisions: local_prefill (the decode pod prefills) or remote_prefill "
            "(a prefill pod computes the KV, the decode pod pulls it).",
            ["path"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "atom:router_prompt_tokens",
            "Prompt tokens of scored requests.",
            registry=r,
        )
        self.matched_tokens = Counter(
            "atom:router_prefix_matched_tokens",
            "Prompt tokens already cached on the chosen decode pod (from its KV events).",
            registry=r,
        )
        self.fallbacks = Counter(
            "atom:router_fallbacks",
            "Requests that did not go the first way chosen: retry (another pod, before the "
            "first byte), prefill_failed (remote prefill failed; the decode pod prefilled), "
            "no_prefill_backend (remote prefill would pay but no prefill pod was ready).",
            ["reason"],
            registry=r,
        )
        self.ejections = Counter(
            "atom:router_ejections",
            "Backends taken out of rotation after a failed request or probe.",
            ["role"],
            registry=r,
        )
        self.latency = Histogram(
            "atom:router_backend_request_seconds",
            "Backend request latency, sent to last byte relayed.",
            ["role", "backend"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queued = Gauge(
            "atom:router_queued_requests",
            "Requests waiting because the role has no ready backend (prefill: requests served "
            "by the decode pods meanwhile). The operator scales a role up from zero while > 0.",
            ["role"],
            registry=r,
        )
        self.demand = Counter(
            "atom:router_demand",
            "Requests that needed the role (every request needs decode; prefill when remote "
            "prefill would pay).",
            ["role"],
            registry=r,
        )
        for role in ROLES:
            self.queued.labels(role)
            self.demand.labels(role)
            self.ejections.labels(role)
        for path in ("local_prefill", "remote_prefill"):
            self.decisions.labels(path)
        for reason in ("retry", "prefill_failed", "no_prefill_backend"):
            self.fallbacks.labels(reason)

    async def render(self) -> bytes:
        return await render(self.registry)

"""Prometheus metrics of `atom serve` (contract 8, docs/architecture.md), in their own registry.

Engine-side numbers (queue lengths, KV usage, cumulative token and cache counters) come from the
latest EngineStats the engine core pushed; they are read at scrape time by a collector, so the
hot path never touches prometheus. Per-request numbers (latencies, finish reasons) are observed by
the API server when a request ends. Rendering runs in a worker thread: a scrape never blocks the
event loop. prometheus-client appends `_total` to counters, so they are declared without it.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from atom_runtime.protocol.engine_core import EngineStats
from atom_runtime.protocol.kv_transfer_stats import KVTransferStats
from atom_runtime.web.metrics import metrics_registry, render

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                 0.5, 0.75, 1.0, 2.5)  # fmt: skip
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                30.0, 40.0, 50.0, 60.0, 120.0)  # fmt: skip


class EngineStatsCollector(Collector):
    """Gauges and counters from the latest EngineStats; nothing before the engine is ready."""

    def __init__(self, latest: Callable[[], EngineStats | None]) -> None:
        self.latest = latest

    def collect(self):
        s = self.latest()
        if s is None:
            return
        yield GaugeMetricFamily(
            "atom:requests_running", "Requests in the running batch.", value=s.num_running
        )
        yield GaugeMetricFamily(
            "atom:requests_waiting", "Requests waiting to be scheduled.", value=s.num_waiting
        )
        yield GaugeMetricFamily(
            "atom:kv_cache_usage_ratio",
            "Fraction of KV-cache blocks in use (1 = full).",
            value=s.kv_cache_usage,
        )
        info = InfoMetricFamily("atom:cache_config", "KV-cache configuration.")
        info.add_metric([], {"block_size": str(s.block_size), "num_gpu_blocks": str(s.num_blocks)})
        yield info
        if s.state_slots_total:  # hybrid models: the recurrent-state slot pool
            yield GaugeMetricFamily(
                "atom:state_slots_total",
                "State slots in the pool (one per resident request).",
                value=s.state_slots_total,
            )
            yield GaugeMetricFamily(
                "atom:state_slots_in_use",
                "State slots held by requests.",
                value=s.state_slots_in_use,
            )
            slot_info = InfoMetricFamily("atom:state_slot_config", "State slot pool configuration.")
            slot_info.add_metric(
                [],
                {
                    "num_slots": str(s.state_slots_total),
                    "bytes_per_slot": str(s.state_slot_bytes),
                },
            )
            yield slot_info
        if s.state_checkpoints is not None:  # hybrid models with state checkpoints on
            yield from s.state_checkpoints.prometheus_families()
        if s.spec_decoding is not None:  # with --speculative-config
            yield from s.spec_decoding.prometheus_families()
        counters = (
            ("atom:prompt_tokens", "Prompt tokens computed.", s.prompt_tokens),
            ("atom:generation_tokens", "Tokens generated.", s.generation_tokens),
            ("atom:preemptions", "Sequences preempted (recompute).", s.num_preemptions),
            (
                "atom:prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
                s.prefix_queries,
            ),
            ("atom:prefix_cache_hits", "Prompt tokens served by the prefix cache.", s.prefix_hits),
            ("atom:kv_events_published", "KV-cache events published.", s.kv_events_published),
            (
                "atom:kv_events_dropped",
                "KV-cache events dropped (publisher queue full).",
                s.kv_events_dropped,
            ),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)
        if s.kv_transfer is not None:
            yield from _kv_transfer_metrics(s.kv_transfer)


def _kv_transfer_metrics(t: KVTransferStats):
    yield GaugeMetricFamily(
        "atom:kv_transfer_held_blocks",
        "Producer: KV blocks held for a consumer's pull.",
        value=t.held_blocks,
    )
    yield GaugeMetricFamily(
        "atom:kv_transfer_pulls_in_flight",
        "Consumer: KV pulls under way (their requests wait).",
        value=t.pulls_in_flight,
    )
    counters = (
        ("atom:kv_transfer_holds_released", "Producer: holds the consumer released.",
         t.holds_released),
        ("atom:kv_transfer_hold_timeouts", "Producer: holds freed unpulled after the hold "
         "timeout.", t.hold_timeouts),
        ("atom:kv_transfer_holds_refused", "Producer: finished prompts not held because the "
         "holds had reached max_held_fraction of the KV cache.", t.holds_refused),
        ("atom:kv_transfer_blocks_sent", "Producer: KV blocks sent.", t.blocks_sent),
        ("atom:kv_transfer_bytes_sent", "Producer: KV bytes sent.", t.bytes_sent),
        ("atom:kv_transfer_pulls", "Consumer: KV pulls completed.", t.pulls_ok),
        ("atom:kv_transfer_blocks_received", "Consumer: KV blocks pulled.", t.blocks_received),
        ("atom:kv_transfer_bytes_received", "Consumer: KV bytes pulled.", t.bytes_received),
        ("atom:kv_transfer_blocks_local_hit", "Consumer: blocks of a transferred prompt it "
         "already cached (not pulled).", t.blocks_local_hit),
        ("atom:kv_transfer_fallbacks", "Consumer: requests prefilled locally because their KV "
         "pull failed or timed out.", t.fallbacks),
    )  # fmt: skip
    for name, doc, value in counters:
        yield CounterMetricFamily(name, doc, value=value)


class ServerMetrics:
    def __init__(self, latest_stats: Callable[[], EngineStats | None]) -> None:
        self.registry = r = metrics_registry(EngineStatsCollector(latest_stats))
        self.requests_finished = Counter(
            "atom:requests_finished",
            "Requests finished, by finish reason (stop, length, abort).",
            ["reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "atom:time_to_first_token_seconds",
            "Arrival to first token, seen by the API server.",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "atom:time_per_output_token_seconds",
            "Mean time between output tokens of a request, after the first.",
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "atom:e2e_request_latency_seconds",
            "Arrival to last token.",
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            "atom:request_queue_time_seconds",
            "Arrival to first scheduled in the engine.",
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        for reason in ("stop", "length", "abort"):
            self.requests_finished.labels(reason)
        self.startup_seconds = Gauge(
            "atom:startup_seconds",
            'Seconds of each start-up phase (system/startup.py); phase="ready" is the whole '
            "start, from the command to /health answering 200 (the rest of it: processes "
            "starting, imports).",
            ["phase"],
            registry=r,
        )

    def record_startup(self, seconds: dict[str, float]) -> None:
        for phase, value in seconds.items():
            self.startup_seconds.labels(phase).set(value)

    def observe_request(
        self,
        reason: str,
        ttft: float | None,
        e2e: float,
        num_output_tokens: int,
        queue_time: float | None,
    ) -> None:
        self.requests_finished.labels(reason).inc()
        self.e2e.observe(e2e)
        if ttft is not None:
            self.ttft.observe(ttft)
            if num_output_tokens > 1:
                self.tpot.observe((e2e - ttft) / (num_output_tokens - 1))
        if queue_time is not None:
            self.queue.observe(max(0.0, queue_time))

    async def render(self) -> bytes:
        return await render(self.registry)

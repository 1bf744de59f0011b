"""Counters of the state-checkpoint system (contract 8: `atom:` prefix, counters end `_total`).

The store, the placement policy and the maintenance queue all count into one
`StateCheckpointCounters`; the engine copies it into its stats message and the API server's
collector turns it into Prometheus families with `prometheus_families`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields

# field -> (metric name without `_total`, label name, label value, help). Fields sharing a metric
# name become one family with a label, so a dashboard can sum or split them.
_COUNTERS: dict[str, tuple[str, str | None, str | None, str]] = {
    "stored": ("atom:state_checkpoints_stored", None, None, "Checkpoints published (READY)."),
    "restored": (
        "atom:state_checkpoints_restored",
        None,
        None,
        "Checkpoint restores that rode a batch into a request's slot.",
    ),
    "dropped": (
        "atom:state_checkpoints_dropped",
        None,
        None,
        "Checkpoints wanted but not kept: no room, cancelled, or superseded by a newer boundary.",
    ),
    "evicted": (
        "atom:state_checkpoints_evicted",
        None,
        None,
        "READY checkpoints evicted whole (LRU, reclaim for live KV, reset).",
    ),
    "orphaned": (
        "atom:state_checkpoints_orphaned",
        None,
        None,
        "Checkpoints unindexed while their copy was in flight, cleaned up after it ran.",
    ),
    "chunks_cut_rung": (
        "atom:state_checkpoint_chunks_cut",
        "reason",
        "rung",
        "Prefill chunks shortened to end exactly on a checkpoint boundary.",
    ),
    "chunks_cut_anchor": ("atom:state_checkpoint_chunks_cut", "reason", "anchor", ""),
    "chunks_cut_demand": ("atom:state_checkpoint_chunks_cut", "reason", "demand", ""),
    "chunks_cut_handoff": ("atom:state_checkpoint_chunks_cut", "reason", "handoff", ""),
    "demands_recorded": (
        "atom:state_checkpoint_demands",
        "outcome",
        "recorded",
        "Demand checkpoints asked for at admission (a KV hit deeper than any checkpoint).",
    ),
    "demands_declined": ("atom:state_checkpoint_demands", "outcome", "declined", ""),
    "prefix_hit_tokens": (
        "atom:state_checkpoint_prefix_hit_tokens",
        None,
        None,
        "Prompt tokens skipped by resuming from a checkpoint (the realized prefix hit).",
    ),
    "hit_lost_tokens": (
        "atom:state_checkpoint_hit_lost_tokens",
        None,
        None,
        "KV-hit tokens recomputed because the deepest checkpoint stopped short of the KV hit.",
    ),
}


@dataclass
class StateCheckpointCounters:
    """Cumulative counts, plus two gauges: units held by checkpoints and units in the KV pool."""

    stored: int = 0
    restored: int = 0
    dropped: int = 0
    evicted: int = 0
    orphaned: int = 0
    chunks_cut_rung: int = 0
    chunks_cut_anchor: int = 0
    chunks_cut_demand: int = 0
    chunks_cut_handoff: int = 0  # where a KV-transfer consumer resumes the request
    demands_recorded: int = 0
    demands_declined: int = 0
    prefix_hit_tokens: int = 0
    hit_lost_tokens: int = 0
    units_in_use: int = 0  # gauge
    pool_units: int = 0  # gauge: blocks in the KV pool

    def prometheus_families(self) -> Iterator:
        """Counter families (prometheus-client appends `_total`) and the units gauges."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        families: dict[str, CounterMetricFamily] = {}
        for f in fields(self):
            spec = _COUNTERS.get(f.name)
            if spec is None:
                continue
            name, label, value, doc = spec
            family = families.get(name)
            if family is None:
                family = CounterMetricFamily(name, doc, labels=[label] if label else None)
                families[name] = family
            family.add_metric([value] if label else [], getattr(self, f.name))
        yield from families.values()
        yield GaugeMetricFamily(
            "atom:state_checkpoint_units",
            "KV-pool blocks lent to state checkpoints.",
            value=self.units_in_use,
        )
        yield GaugeMetricFamily(
            "atom:state_checkpoint_units_ratio",
            "Share of the KV pool lent to state checkpoints.",
            value=self.units_in_use / self.pool_units if self.pool_units else 0.0,
        )

"""The built-in autoscaler's arithmetic: parse a pod's /metrics, decide a role's replicas. Pure.

The handlers (`atom_operator.handlers`, the `autoscale` timer) scrape every ready pod of a role
and the router's demand gauge, call `decide` and write the answer to the role's Deployment. This
module does no I/O and reads no clock: the caller passes the time, so every decision can be
replayed from a synthetic metric series.

What a decision does, in order:

1. Per target set in the spec, the replicas that would bring the per-pod average to the target:
   `ceil(total / target)` for the load gauges (requests waiting, requests running, KV-cache
   usage) and `ceil(pods * p90 / target)` for the TTFT p90 (from the histogram's increase since
   the previous scrape). The largest wins. Pods that returned no usable metrics count as sitting
   exactly at the target when the role would shrink (so a pod we cannot see never causes a
   scale-down) and as carrying no load when it would grow. Within 10% of the current load per
   pod nothing changes (`TOLERANCE`), so a role does not flap around its target.
2. Scale-down is stabilised: the replicas used are the largest recommendation of the last
   `scaleDownStabilizationSeconds`. Scale-up is stabilised the other way (the smallest of the
   last `scaleUpStabilizationSeconds`) unless it is a surge: a recommendation of at least
   `SURGE_RATIO` times the current replicas acts at once.
3. One decision moves at most `maxStep` pods, except a surge, which may double the role.
4. The result is clamped to [minReplicas, maxReplicas]; a role whose recommendation is above
   maxReplicas is reported as limited (`Decision.limited == "max"`), never silently saturated.
5. Scale-to-zero (minReplicas 0): the role goes to 0 only after `scaleToZeroAfterSeconds` with no
   running or waiting request on any pod and no request queued at the router for it; at 0 it
   comes back to max(1, ...) as soon as the router reports a queued request for the role.

Prefill pods are meant to scale on prompt tokens waiting; the engine exposes no such gauge (only
`atom:prompt_tokens`, a counter of tokens already computed), so prefill scales on requests
waiting (and any other target set); decode on requests running and KV-cache usage.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

# The engine's metric names (runtime/atom_runtime/server/metrics.py) and the router's.
REQUESTS_WAITING = "atom:requests_waiting"
REQUESTS_RUNNING = "atom:requests_running"
KV_CACHE_USAGE = "atom:kv_cache_usage_ratio"
TTFT = "atom:time_to_first_token_seconds"
ROUTER_QUEUED = "atom:router_queued_requests"

TOLERANCE = 0.1
SURGE_RATIO = 2.0
TTFT_QUANTILE = 0.9


class MetricsError(ValueError):
    """A /metrics body the autoscaler cannot use (not the exposition format, a gauge missing,
    a value that is not a finite non-negative number)."""


@dataclasses.dataclass(frozen=True)
class PodMetrics:
    """One pod's scrape: gauges and the TTFT histogram's cumulative buckets (upper bound ->
    count, +Inf included). `error` is set (and the numbers are None) when the scrape failed."""

    pod: str
    requests_waiting: float | None = None
    requests_running: float | None = None
    kv_cache_usage: float | None = None
    ttft_buckets: tuple[tuple[float, float], ...] = ()
    error: str = ""

    @property
    def usable(self) -> bool:
        return not self.error


def _finite(name: str, value: float) -> float:
    if not math.isfinite(value) or value < 0:
        raise MetricsError(f"{name} is {value}, not a finite non-negative number")
    return float(value)


def parse_engine_metrics(pod: str, text: str) -> PodMetrics:
    """The gauges and TTFT buckets of one `atom serve` /metrics body (raises MetricsError)."""
    gauges: dict[str, float] = {}
    buckets: dict[float, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in (REQUESTS_WAITING, REQUESTS_RUNNING, KV_CACHE_USAGE):
                    gauges[sample.name] = _finite(sample.name, sample.value)
                elif sample.name == f"{TTFT}_bucket":
                    buckets[float(sample.labels["le"])] = _finite(sample.name, sample.value)
    except MetricsError:
        raise
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise MetricsError(f"not the Prometheus text format: {exc}") from exc
    missing = [name for name in (REQUESTS_WAITING, REQUESTS_RUNNING, KV_CACHE_USAGE)
               if name not in gauges]  # fmt: skip
    if missing:
        raise MetricsError(f"no {', '.join(missing)} (is the engine ready?)")
    return PodMetrics(
        pod=pod,
        requests_waiting=gauges[REQUESTS_WAITING],
        requests_running=gauges[REQUESTS_RUNNING],
        kv_cache_usage=gauges[KV_CACHE_USAGE],
        ttft_buckets=tuple(sorted(buckets.items())),
    )


def parse_router_queue(text: str) -> dict[str, float]:
    """role -> requests the router holds for that role (`atom:router_queued_requests`)."""
    queued: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == ROUTER_QUEUED and "role" in sample.labels:
                    role = sample.labels["role"]
                    queued[role] = queued.get(role, 0.0) + _finite(sample.name, sample.value)
    except MetricsError:
        raise
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise MetricsError(f"not the Prometheus text format: {exc}") from exc
    return queued


def bucket_increase(
    now: Sequence[tuple[float, float]], before: Sequence[tuple[float, float]]
) -> tuple[tuple[float, float], ...]:
    """Cumulative buckets observed between two scrapes of one pod; `now` itself when the
    counters went backwards (the engine restarted) or the bucket bounds changed."""
    if [b for b, _ in before] != [b for b, _ in now]:
        return tuple(now)
    deltas = tuple(
        (bound, count - old) for (bound, count), (_, old) in zip(now, before, strict=True)
    )
    if any(delta < 0 for _, delta in deltas):
        return tuple(now)
    return deltas


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile over cumulative (upper bound, count) buckets: linear
    interpolation inside the bucket holding rank q * total; None with no observation."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound  # above the last finite bound: its value, as Prometheus
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                count - lower_count
            )
        lower_bound, lower_count = bound, count
    return lower_bound


@dataclasses.dataclass(frozen=True)
class Policy:
    """One role's autoscaling spec (spec.<role>.autoscaling, defaulted)."""

    min_replicas: int
    max_replicas: int
    target_requests_waiting: float | None = None
    target_requests_running: float | None = None
    target_kv_cache_usage: float | None = None
    target_ttft_p90_seconds: float | None = None
    scale_up_stabilization_s: float = 0.0
    scale_down_stabilization_s: float = 300.0
    max_step: int = 4
    scale_to_zero_after_s: float = 300.0

    @classmethod
    def from_spec(cls, autoscaling: Mapping[str, Any]) -> Policy:
        return cls(
            min_replicas=int(autoscaling["minReplicas"]),
            max_replicas=int(autoscaling["maxReplicas"]),
            target_requests_waiting=autoscaling.get("targetRequestsWaiting"),
            target_requests_running=autoscaling.get("targetRequestsRunning"),
            target_kv_cache_usage=autoscaling.get("targetKVCacheUsage"),
            target_ttft_p90_seconds=autoscaling.get("targetTTFTSeconds"),
            scale_up_stabilization_s=float(autoscaling["scaleUpStabilizationSeconds"]),
            scale_down_stabilization_s=float(autoscaling["scaleDownStabilizationSeconds"]),
            max_step=int(autoscaling["maxStep"]),
            scale_to_zero_after_s=float(autoscaling["scaleToZeroAfterSeconds"]),
        )


@dataclasses.dataclass(frozen=True)
class History:
    """What one decision hands to the next: recent recommendations (time, replicas), when the
    role last became idle, and the previous TTFT buckets per pod."""

    recommendations: tuple[tuple[float, int], ...] = ()
    idle_since: float | None = None
    ttft_buckets: Mapping[str, tuple[tuple[float, float], ...]] = dataclasses.field(
        default_factory=dict
    )


@dataclasses.dataclass(frozen=True)
class Decision:
    """The replicas to run, why, and what was observed (for status and the event)."""

    desired: int
    current: int
    recommended: int  # before stabilisation, step bound and [min, max]
    reason: str
    metrics: dict[str, float]
    limited: str = ""  # "max" when the role needs more than maxReplicas

    @property
    def changed(self) -> bool:
        return self.desired != self.current


def _average(pods: Sequence[PodMetrics], field: str) -> float:
    return sum(getattr(p, field) for p in pods) / len(pods)


def _recommend(
    policy: Policy, current: int, usable: Sequence[PodMetrics], missing: int, ttft_p90: float | None
) -> tuple[int, str, dict[str, float]]:
    """Replicas wanted by the most demanding target, the target's name and the averages."""
    n = len(usable)
    metrics = {
        "pods": float(n),
        "podsWithoutMetrics": float(missing),
        "requestsWaiting": _average(usable, "requests_waiting"),
        "requestsRunning": _average(usable, "requests_running"),
        "kvCacheUsage": round(_average(usable, "kv_cache_usage"), 4),
    }
    if ttft_p90 is not None:
        metrics["ttftP90Seconds"] = round(ttft_p90, 4)
    loads = [
        ("requestsWaiting", policy.target_requests_waiting, "requests_waiting"),
        ("requestsRunning", policy.target_requests_running, "requests_running"),
        ("kvCacheUsage", policy.target_kv_cache_usage, "kv_cache_usage"),
    ]
    wants: list[tuple[int, str]] = []
    for name, target, field in loads:
        if target is None:
            continue
        total = sum(getattr(p, field) for p in usable)
        ratio = total / (n * target)
        if abs(ratio - 1.0) <= TOLERANCE:
            wants.append((current, f"{name} {metrics[name]:g}/pod is within 10% of {target:g}"))
            continue
        # A pod we cannot see counts at the target when shrinking, as idle when growing.
        replicas = math.ceil(total / target - 1e-9) + (missing if ratio < 1 else 0)
        wants.append((replicas, f"{name} {metrics[name]:g}/pod vs target {target:g}"))
    if policy.target_ttft_p90_seconds is not None and ttft_p90 is not None:
        target = policy.target_ttft_p90_seconds
        ratio = ttft_p90 / target
        if abs(ratio - 1.0) <= TOLERANCE:
            wants.append((current, f"TTFT p90 {ttft_p90:.3g}s is within 10% of {target:g}s"))
        else:
            replicas = math.ceil(n * ratio - 1e-9) + (missing if ratio < 1 else 0)
            wants.append((replicas, f"TTFT p90 {ttft_p90:.3g}s vs target {target:g}s"))
    if not wants:
        return current, "no target has data", metrics
    replicas, why = max(wants, key=lambda want: want[0])
    return replicas, why, metrics


def _ttft_p90(
    pods: Sequence[PodMetrics], history: History
) -> tuple[float | None, dict[str, tuple[tuple[float, float], ...]]]:
    """The p90 of the TTFTs observed on every pod since the previous scrape, and the buckets
    to remember. A pod seen for the first time contributes nothing yet (no baseline)."""
    merged: dict[float, float] = {}
    remember: dict[str, tuple[tuple[float, float], ...]] = {}
    for pod in pods:
        if not pod.ttft_buckets:
            continue
        remember[pod.pod] = pod.ttft_buckets
        before = history.ttft_buckets.get(pod.pod)
        if before is None:
            continue
        for bound, count in bucket_increase(pod.ttft_buckets, before):
            merged[bound] = merged.get(bound, 0.0) + count
    return histogram_quantile(TTFT_QUANTILE, sorted(merged.items())), remember


def _window(history: History, now: float, keep: float) -> tuple[tuple[float, int], ...]:
    return tuple((t, r) for t, r in history.recommendations if now - t <= keep)


def _stabilized(
    policy: Policy, history: History, now: float, current: int, recommended: int
) -> tuple[int, str]:
    """The replicas to move to from `current` toward `recommended`, and how ("surge",
    "scale-up", "scale-down", "steady"): a rise holds until its whole stabilization window
    agrees (a surge acts at once), a fall until every recommendation of its window agrees, and
    one decision moves at most maxStep (a surge may double)."""
    surge = recommended >= SURGE_RATIO * current
    if recommended > current:
        if surge:
            stable, mode = recommended, "surge"
        else:
            ups = [r for t, r in _window(history, now, policy.scale_up_stabilization_s)]
            stable, mode = min([*ups, recommended]), "scale-up"
        step = max(policy.max_step, current) if surge else policy.max_step
        # A window whose smallest recommendation is below `current` holds, never shrinks.
        return min(max(stable, current), current + step), mode
    if recommended < current:
        downs = [r for t, r in _window(history, now, policy.scale_down_stabilization_s)]
        stable = max([*downs, recommended])
        return max(min(stable, current), current - policy.max_step), "scale-down"
    return current, "steady"


def decide(
    policy: Policy,
    *,
    now: float,
    current: int,
    pods: Iterable[PodMetrics],
    router_queued: float | None,
    history: History,
) -> tuple[Decision, History]:
    """The replicas one role should run now, and the history for the next call.

    `current` is the Deployment's spec.replicas, `pods` the scrapes of its ready pods (failed
    ones carry an error), `router_queued` the requests the router holds for this role (None
    when there is no router to ask).
    """
    pods = list(pods)
    usable = [p for p in pods if p.usable]
    missing = len(pods) - len(usable)
    ttft_p90, ttft_seen = _ttft_p90(usable, history)
    queued = router_queued or 0.0
    low, high = policy.min_replicas, policy.max_replicas
    keep = max(policy.scale_up_stabilization_s, policy.scale_down_stabilization_s)

    def done(
        desired: int, recommended: int, reason: str, metrics: dict[str, float], idle: float | None
    ) -> tuple[Decision, History]:
        limited = "max" if recommended > high else ""
        if limited:
            reason += f"; limited by maxReplicas {high} (wants {recommended})"
        window = _window(history, now, keep) + ((now, recommended),)
        return (
            Decision(desired, current, recommended, reason, metrics, limited),
            History(recommendations=window, idle_since=idle, ttft_buckets=ttft_seen),
        )

    base_metrics = {"routerQueued": queued} if router_queued is not None else {}

    if current == 0:
        if queued > 0:
            desired = min(high, max(1, low))
            why = f"{queued:g} request(s) queued at the router"
            return done(desired, desired, why, base_metrics, None)
        if low > 0:
            return done(low, low, f"below minReplicas {low}", base_metrics, None)
        return done(0, 0, "scaled to zero, no queued demand", base_metrics, history.idle_since)

    if not usable:
        # Starting pods or a broken scrape: keep the replicas we have, within the bounds.
        desired = min(high, max(low, current))
        why = f"no usable metrics from {len(pods)} ready pod(s); holding"
        if pods:
            why += f" ({pods[0].pod}: {pods[0].error})" if pods[0].error else ""
        return done(desired, desired, why, {**base_metrics, "pods": 0.0,
                    "podsWithoutMetrics": float(missing)}, history.idle_since)  # fmt: skip

    recommended, why, metrics = _recommend(policy, current, usable, missing, ttft_p90)
    metrics.update(base_metrics)
    idle = (
        missing == 0
        and queued == 0
        and all(p.requests_waiting == 0 and p.requests_running == 0 for p in usable)
    )
    idle_since = (history.idle_since if history.idle_since is not None else now) if idle else None

    if low == 0 and idle and idle_since is not None:
        idle_for = now - idle_since
        if idle_for >= policy.scale_to_zero_after_s:
            return done(0, 0, f"idle for {idle_for:g}s: scaling to zero", metrics, idle_since)
    if low == 0 and idle and idle_since is not None:
        why += f"; idle {now - idle_since:g}s of {policy.scale_to_zero_after_s:g}s before zero"
    floor = max(1, low)  # zero only through the idle timer above
    target, mode = _stabilized(policy, history, now, current, recommended)
    desired = min(high, max(floor, target))
    if desired == current and mode != "steady":
        why += f" ({mode} held by stabilization)" if target == current else ""
    elif desired != current:
        why = f"{mode}: {why}"
    return done(desired, recommended, why, metrics, idle_since)

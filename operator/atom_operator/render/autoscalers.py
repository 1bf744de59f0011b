"""The autoscaler objects of a role: an autoscaling/v2 HorizontalPodAutoscaler (provider hpa)
or a KEDA ScaledObject (provider keda); provider builtin renders nothing (the operator scales)."""

from __future__ import annotations

import copy
from typing import Any

from atom_operator.render.names import (
    child_metadata,
    child_name,
    defaulted_spec,
    namespace_of,
    role_labels,
)

# Custom-metrics names of the engine's gauges as the Prometheus adapter exposes them (the adapter
# rule in docs/operator.md renames atom:<x> to atom_<x>).
METRIC_REQUESTS_WAITING = "atom_requests_waiting"
METRIC_KV_CACHE_USAGE = "atom_kv_cache_usage_ratio"
METRIC_REQUESTS_RUNNING = "atom_requests_running"
KEDA_POLLING_SECONDS = 15


def quantity(value: float) -> str:
    """A number as a Kubernetes quantity string: 4 -> "4", 0.8 -> "800m"."""
    if float(value).is_integer():
        return str(int(value))
    return f"{max(1, round(value * 1000))}m"


def _pods_metric(name: str, average: float) -> dict[str, Any]:
    return {
        "type": "Pods",
        "pods": {
            "metric": {"name": name},
            "target": {"type": "AverageValue", "averageValue": quantity(average)},
        },
    }


def autoscaler(spec: dict[str, Any], role: str) -> str:
    """Who owns the role's replica count: "" (the spec), "builtin", "keda" or "hpa"."""
    autoscaling = spec[role]["autoscaling"]
    return autoscaling["provider"] if autoscaling["enabled"] else ""


def render_hpa(body: dict[str, Any], role: str) -> dict[str, Any] | None:
    """The role's HorizontalPodAutoscaler, or None unless the role autoscales with provider hpa."""
    spec = defaulted_spec(body)
    autoscaling = spec[role]["autoscaling"]
    if autoscaler(spec, role) != "hpa":
        return None
    metrics = []
    if "targetRequestsWaiting" in autoscaling:
        metrics.append(_pods_metric(METRIC_REQUESTS_WAITING, autoscaling["targetRequestsWaiting"]))
    if "targetRequestsRunning" in autoscaling:
        metrics.append(_pods_metric(METRIC_REQUESTS_RUNNING, autoscaling["targetRequestsRunning"]))
    if "targetKVCacheUsage" in autoscaling:
        metrics.append(_pods_metric(METRIC_KV_CACHE_USAGE, autoscaling["targetKVCacheUsage"]))
    hpa_spec: dict[str, Any] = {
        "scaleTargetRef": {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": child_name(body, role),
        },  # fmt: skip
        "minReplicas": autoscaling["minReplicas"],
        "maxReplicas": autoscaling["maxReplicas"],
        "metrics": metrics,
    }
    if autoscaling.get("behavior"):
        hpa_spec["behavior"] = copy.deepcopy(autoscaling["behavior"])
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": child_metadata(body, child_name(body, role), role_labels(body, role)),
        "spec": hpa_spec,
    }


def _prometheus_trigger(
    address: str, name: str, query: str, threshold: float, metric_type: str
) -> dict[str, Any]:
    return {
        "type": "prometheus",
        "name": name,
        "metricType": metric_type,
        "metadata": {
            "serverAddress": address,
            "query": query,
            "threshold": f"{threshold:g}",
        },
    }


def render_scaled_object(body: dict[str, Any], role: str) -> dict[str, Any] | None:
    """The role's KEDA ScaledObject, or None unless the role autoscales with provider keda.

    Each target becomes a Prometheus trigger on the engine's own metric, summed over the role's
    pods (found by the `namespace` and `pod` labels of Prometheus' Kubernetes discovery) and
    compared per pod (AverageValue); TTFT p90 is one value for the role (Value). With
    minReplicas 0 a trigger on the router's queued-request gauge activates the role from zero.
    """
    spec = defaulted_spec(body)
    autoscaling = spec[role]["autoscaling"]
    if autoscaler(spec, role) != "keda":
        return None
    address = autoscaling["keda"]["serverAddress"]
    namespace = namespace_of(body) or "default"
    pods = f'namespace="{namespace}",pod=~"{child_name(body, role)}-[a-z0-9]+-[a-z0-9]+"'
    triggers = []
    gauges = [
        ("targetRequestsWaiting", "requests-waiting", "atom:requests_waiting"),
        ("targetRequestsRunning", "requests-running", "atom:requests_running"),
        ("targetKVCacheUsage", "kv-cache-usage", "atom:kv_cache_usage_ratio"),
    ]
    for field, name, metric in gauges:
        if field in autoscaling:
            query = f"sum({metric}{{{pods}}})"
            triggers.append(
                _prometheus_trigger(address, name, query, autoscaling[field], "AverageValue")
            )
    if "targetTTFTSeconds" in autoscaling:
        query = (
            "histogram_quantile(0.9, sum by (le) "
            f"(rate(atom:time_to_first_token_seconds_bucket{{{pods}}}[2m])))"
        )
        triggers.append(
            _prometheus_trigger(
                address, "ttft-p90", query, autoscaling["targetTTFTSeconds"], "Value"
            )
        )
    if autoscaling["minReplicas"] == 0:
        query = f'sum(atom:router_queued_requests{{namespace="{namespace}",role="{role}"}})'
        trigger = _prometheus_trigger(address, "router-queued", query, 1, "AverageValue")
        trigger["metadata"]["activationThreshold"] = "0"
        triggers.append(trigger)
    scale_down = {"stabilizationWindowSeconds": autoscaling["scaleDownStabilizationSeconds"]}
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": child_metadata(body, child_name(body, role), role_labels(body, role)),
        "spec": {
            "scaleTargetRef": {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "name": child_name(body, role),
            },  # fmt: skip
            "minReplicaCount": autoscaling["minReplicas"],
            "maxReplicaCount": autoscaling["maxReplicas"],
            "pollingInterval": KEDA_POLLING_SECONDS,
            "cooldownPeriod": autoscaling["scaleToZeroAfterSeconds"],
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": {"scaleDown": scale_down}}},
            "triggers": triggers,
        },
    }

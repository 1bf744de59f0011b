"""The engine roles (decode, prefill) and their autoscaling section."""

from __future__ import annotations

import copy
from typing import Any

from atom_operator.schema.fields import (
    ARGS_LIST,
    ENV_LIST,
    RESOURCES,
    free_object,
    int_field,
    object_field,
    str_field,
)

AUTOSCALING_PROVIDERS = ["builtin", "keda", "hpa"]
_TARGET = {"type": "number", "minimum": 0, "exclusiveMinimum": True}

AUTOSCALING = object_field(
    "Autoscaling of this role on the engine's metrics. provider builtin (default): the operator "
    "scrapes the pods' /metrics itself and sets the Deployment's replicas (nothing else to "
    "install); keda: a KEDA ScaledObject with Prometheus triggers; hpa: an autoscaling/v2 "
    "HorizontalPodAutoscaler on custom metrics (needs the Prometheus adapter). When enabled the "
    "role's Deployment is rendered without `replicas`: the autoscaler is its only writer.",
    {
        "enabled": {"type": "boolean", "default": False},
        "provider": str_field(
            "Who scales the role.", default="builtin", enum=list(AUTOSCALING_PROVIDERS)
        ),
        "minReplicas": int_field(
            "Lower bound. 0 (builtin or keda, with the router in front: spec.router.enabled, "
            "always so with a prefill role): scale to zero after scaleToZeroAfterSeconds idle, "
            "back up on queued demand.",
            default=1,
            minimum=0,
        ),
        "maxReplicas": int_field("Upper bound; required when enabled.", minimum=1),
        "targetRequestsWaiting": {
            **_TARGET,
            "description": "atom:requests_waiting per pod to aim for (prefill's signal).",
        },
        "targetRequestsRunning": {
            **_TARGET,
            "description": "atom:requests_running per pod to aim for (decode's signal).",
        },
        "targetKVCacheUsage": {
            **_TARGET,
            "maximum": 1,
            "description": "atom:kv_cache_usage_ratio per pod (0-1] to aim for (decode).",
        },
        "targetTTFTSeconds": {
            **_TARGET,
            "description": "p90 of atom:time_to_first_token_seconds to aim for (builtin, keda).",
        },
        "scaleUpStabilizationSeconds": int_field(
            "builtin: a rise must hold this long before pods are added (the smallest "
            "recommendation of the window wins); a surge (2x the current pods) acts at once.",
            default=0,
            minimum=0,
            maximum=3600,
        ),
        "scaleDownStabilizationSeconds": int_field(
            "Pods are removed only when every recommendation of this window agrees (builtin; "
            "keda and hpa get it as the HPA behavior's scale-down window).",
            default=300,
            minimum=0,
            maximum=3600,
        ),
        "maxStep": int_field(
            "builtin: most pods added or removed by one decision (a surge may double).",
            default=4,
            minimum=1,
        ),
        "scaleToZeroAfterSeconds": int_field(
            "With minReplicas 0: idle time (no running, waiting or queued request) before the "
            "role goes to zero (builtin; keda's cooldownPeriod).",
            default=300,
            minimum=0,
        ),
        "keda": object_field(
            "provider keda: where KEDA's Prometheus triggers query the engine's metrics.",
            {
                "serverAddress": str_field(
                    "Prometheus base URL, e.g. http://prometheus.monitoring:9090.",
                    pattern=r"^https?://\S+$",
                ),
            },
        ),
        "behavior": free_object(
            "provider hpa: autoscaling/v2 HorizontalPodAutoscalerBehavior, passed through."
        ),
    },
    default={},
    **{
        "x-kubernetes-validations": [
            {
                "rule": "!has(self.minReplicas) || !has(self.maxReplicas) "
                "|| self.minReplicas <= self.maxReplicas",
                "message": "minReplicas must be <= maxReplicas",
                "fieldPath": ".minReplicas",
            },
            {
                "rule": "!has(self.enabled) || !self.enabled || has(self.maxReplicas)",
                "message": "maxReplicas is required when autoscaling is enabled",
                "fieldPath": ".maxReplicas",
            },
            {
                "rule": "!has(self.enabled) || !self.enabled || has(self.targetRequestsWaiting) "
                "|| has(self.targetRequestsRunning) || has(self.targetKVCacheUsage) "
                "|| has(self.targetTTFTSeconds)",
                "message": "set at least one of targetRequestsWaiting, targetRequestsRunning, "
                "targetKVCacheUsage, targetTTFTSeconds when autoscaling is enabled",
                "fieldPath": ".enabled",
            },
            {
                "rule": "!has(self.enabled) || !self.enabled || !has(self.provider) "
                "|| self.provider != 'keda' || (has(self.keda) && has(self.keda.serverAddress))",
                "message": "provider keda needs keda.serverAddress (the Prometheus URL)",
                "fieldPath": ".keda",
            },
            {
                "rule": "!has(self.provider) || self.provider != 'hpa' "
                "|| !has(self.minReplicas) || self.minReplicas >= 1",
                "message": "provider hpa cannot scale to zero: minReplicas must be >= 1",
                "fieldPath": ".minReplicas",
            },
            {
                "rule": "!has(self.provider) || self.provider != 'hpa' "
                "|| !has(self.targetTTFTSeconds)",
                "message": "provider hpa has no TTFT quantile metric: use builtin or keda",
                "fieldPath": ".targetTTFTSeconds",
            },
        ]
    },
)


def role_section(description: str, default: Any = None) -> dict[str, Any]:
    return object_field(
        description,
        {
            "replicas": int_field(
                "Pods of this role (ignored while autoscaling is enabled).", default=1, minimum=0
            ),
            "tensorParallelSize": int_field(
                "GPUs per pod; each pod requests this many accelerator devices.",
                default=1,
                minimum=1,
                maximum=16,
            ),
            "resources": copy.deepcopy(RESOURCES),
            "args": dict(
                ARGS_LIST,
                description="Extra `atom serve` arguments for this role, "
                "placed after spec.engine.args.",
            ),  # fmt: skip
            "env": copy.deepcopy(ENV_LIST),
            "autoscaling": copy.deepcopy(AUTOSCALING),
        },
        default=default,
    )

"""Per engine role: its Deployment, headless Service and PodDisruptionBudget; and the
user-facing Service."""

from __future__ import annotations

from typing import Any

from atom_operator.model_source import model_source
from atom_operator.render.engine_pod import engine_pod_spec, engine_ports
from atom_operator.render.model_volume import SOURCE_ANNOTATION, source_digest
from atom_operator.render.names import (
    ENGINE_CONTAINER,
    ROUTER,
    child_metadata,
    child_name,
    common_labels,
    defaulted_spec,
    role_labels,
    role_selector,
)
from atom_operator.spec import has_router


def render_role_deployment(body: dict[str, Any], role: str) -> dict[str, Any]:
    """The Deployment of one role; without `replicas` when the role autoscales (the HPA owns it)."""
    spec = defaulted_spec(body)
    role_spec = spec[role]
    labels = role_labels(body, role)
    deployment_spec: dict[str, Any] = {}
    if not role_spec["autoscaling"]["enabled"]:
        deployment_spec["replicas"] = role_spec["replicas"]
    deployment_spec.update(
        {
            "selector": {"matchLabels": role_selector(body, role)},
            # Surge, never drop: a new pod that finds no free GPU stays Pending while the old
            # one keeps serving, instead of taking capacity away first.
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "progressDeadlineSeconds": spec["engine"]["startupTimeoutSeconds"] + 600,
            "revisionHistoryLimit": 3,
            "template": {
                "metadata": {
                    "labels": labels,
                    "annotations": {
                        "kubectl.kubernetes.io/default-container": ENGINE_CONTAINER,
                        SOURCE_ANNOTATION: source_digest(model_source(spec["model"])),
                    },
                },
                "spec": engine_pod_spec(body, role),
            },
        }
    )
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": child_metadata(body, child_name(body, role), labels),
        "spec": deployment_spec,
    }


def render_role_service(body: dict[str, Any], role: str) -> dict[str, Any]:
    """A headless Service per role: per-pod DNS records for the router and KV-event consumers."""
    spec = defaulted_spec(body)
    ports = [
        {
            "name": port["name"],
            "port": port["containerPort"],
            "targetPort": port["name"],
            "protocol": "TCP",
        }  # fmt: skip
        for port in engine_ports(spec)
    ]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(body, child_name(body, role), role_labels(body, role)),
        "spec": {
            "clusterIP": "None",
            "selector": role_selector(body, role),
            "ports": ports,
        },
    }


def render_service(body: dict[str, Any]) -> dict[str, Any]:
    """The user-facing Service: the router when there is one, else the decode pods."""
    spec = defaulted_spec(body)
    service = spec["service"]
    target = ROUTER if has_router(spec) else "decode"
    metadata = child_metadata(body, child_name(body), common_labels(body))
    if service["annotations"]:
        metadata["annotations"] = dict(service["annotations"])
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata,
        "spec": {
            "type": service["type"],
            "selector": role_selector(body, target),
            "ports": [
                {"name": "http", "port": service["port"], "targetPort": "http", "protocol": "TCP"}
            ],
        },
    }


def render_pdb(body: dict[str, Any], role: str) -> dict[str, Any]:
    """At most one pod of a role voluntarily disrupted at a time; pods that never became ready
    (still loading the model) may always be evicted."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": child_metadata(body, child_name(body, role), role_labels(body, role)),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": role_selector(body, role)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }

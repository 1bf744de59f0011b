"""Who may reach the pods: the NetworkPolicy, and the InferencePool an inference gateway uses."""

from __future__ import annotations

import copy
from typing import Any

from atom_operator.render.names import (
    DEPLOYMENT_LABEL,
    child_metadata,
    child_name,
    common_labels,
    defaulted_spec,
    label_value,
    name_of,
)
from atom_operator.schema import ENGINE_HTTP_PORT


def render_network_policy(body: dict[str, Any]) -> dict[str, Any] | None:
    """Ingress to every pod of the AtomDeployment: the HTTP port from anywhere (clients come
    through the Service, the operator scrapes /metrics); everything else (KV events, replay, KV
    transfer) only from pods of the same AtomDeployment and from spec.networkPolicy.kvEventsFrom
    on the KV-event ports. None when spec.networkPolicy.enabled is false."""
    spec = defaulted_spec(body)
    policy = spec["networkPolicy"]
    if not policy["enabled"]:
        return None
    own_pods = {"podSelector": {"matchLabels": {DEPLOYMENT_LABEL: label_value(name_of(body))}}}
    rules: list[dict[str, Any]] = [
        {"ports": [{"protocol": "TCP", "port": ENGINE_HTTP_PORT}]},
        {"from": [own_pods]},
    ]
    events = spec["kvEvents"]
    if events["enabled"] and policy["kvEventsFrom"]:
        rules.append(
            {
                "from": copy.deepcopy(policy["kvEventsFrom"]),
                "ports": [
                    {"protocol": "TCP", "port": events["port"]},
                    {"protocol": "TCP", "port": events["replayPort"]},
                ],
            }
        )
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": child_metadata(body, child_name(body), common_labels(body)),
        "spec": {
            "podSelector": {"matchLabels": {DEPLOYMENT_LABEL: label_value(name_of(body))}},
            "policyTypes": ["Ingress"],
            "ingress": rules,
        },
    }


def render_inference_pool(body: dict[str, Any]) -> dict[str, Any] | None:
    """An InferencePool (inference.networking.k8s.io/v1) over every pod that serves requests
    (the engine roles, not the router: llm-d's endpoint picker tells prefill from decode by the
    llm-d.ai/role label), or None unless spec.inferencePool.enabled."""
    spec = defaulted_spec(body)
    pool = spec["inferencePool"]
    if not pool["enabled"]:
        return None
    picker = pool["endpointPicker"]
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": child_metadata(body, child_name(body), common_labels(body)),
        "spec": {
            "selector": {
                "matchLabels": {
                    DEPLOYMENT_LABEL: label_value(name_of(body)),
                    "llm-d.ai/inferenceServing": "true",
                }
            },
            "targetPorts": [{"number": ENGINE_HTTP_PORT}],
            "endpointPickerRef": {
                "kind": "Service",
                "name": picker["name"],
                "port": {"number": picker["port"]},
                "failureMode": picker["failureMode"],
            },
        },
    }

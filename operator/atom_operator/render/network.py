"""Who may reach the pods: the NetworkPolicy, and the InferencePool an inference gateway uses."""

from __future__ import annotations

import copy
from typing import Any

from atom_operator.operator_config import DEFAULT_CONFIG, OperatorConfig
from atom_operator.render.names import (
    DEPLOYMENT_LABEL,
    ROLE_LABEL,
    ROUTER,
    child_metadata,
    child_name,
    common_labels,
    defaulted_spec,
    is_disaggregated,
    label_value,
    name_of,
    role_selector,
)
from atom_operator.schema import ENGINE_HTTP_PORT
from atom_operator.spec import ROLES, has_router

MAX_PORT = 65535


def _deployment_pods(body: dict[str, Any]) -> dict[str, Any]:
    """A podSelector for every pod of the AtomDeployment (engines and router)."""
    return {"matchLabels": {DEPLOYMENT_LABEL: label_value(name_of(body))}}


def _engine_pods(body: dict[str, Any]) -> dict[str, Any]:
    """A podSelector for the AtomDeployment's engine pods (decode and prefill)."""
    selector = _deployment_pods(body)
    selector["matchExpressions"] = [{"key": ROLE_LABEL, "operator": "In", "values": list(ROLES)}]
    return selector


def _tcp(*ports: int) -> list[dict[str, Any]]:
    return [{"protocol": "TCP", "port": port} for port in ports]


def ports_except(excluded: set[int]) -> list[dict[str, Any]]:
    """Every TCP port but `excluded`, as NetworkPolicyPorts (ranges with endPort): the KV
    transfer's ports are the connector's business (a payload port may be any free port)."""
    ports, start = [], 1
    for port in sorted(excluded) + [MAX_PORT + 1]:
        if port > start:
            entry: dict[str, Any] = {"protocol": "TCP", "port": start}
            if port - 1 > start:
                entry["endPort"] = port - 1
            ports.append(entry)
        start = port + 1
    return ports


def _engine_ingress(body: dict[str, Any], config: OperatorConfig) -> list[dict[str, Any]]:
    """Who may reach the engine pods, port by port (see `render_network_policies`)."""
    spec = defaulted_spec(body)
    policy, events = spec["networkPolicy"], spec["kvEvents"]
    routed = has_router(spec)
    router_pods = {"podSelector": {"matchLabels": role_selector(body, ROUTER)}}
    rules: list[dict[str, Any]] = []
    if routed:
        http_from = [{"podSelector": _deployment_pods(body)}]
        peer = config.operator_peer()
        if peer is not None:
            http_from.append(peer)
        http_from += copy.deepcopy(policy["httpFrom"])
        rules.append({"from": http_from, "ports": _tcp(ENGINE_HTTP_PORT)})
    else:
        rules.append({"ports": _tcp(ENGINE_HTTP_PORT)})
    event_ports = {events["port"], events["replayPort"]} if events["enabled"] else set()
    events_from = ([router_pods] if routed else []) + copy.deepcopy(policy["kvEventsFrom"])
    if event_ports and events_from:
        rules.append({"from": events_from, "ports": _tcp(events["port"], events["replayPort"])})
    if is_disaggregated(spec):
        # Decode pulls KV from prefill on the connector's ports: engine pods only.
        transfer_ports = ports_except({ENGINE_HTTP_PORT, *event_ports})
        rules.append({"from": [{"podSelector": _engine_pods(body)}], "ports": transfer_ports})
    return rules


def _policy(body: dict[str, Any], name: str, pods: dict[str, Any], ingress: list) -> dict:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": child_metadata(body, name, common_labels(body)),
        "spec": {"podSelector": pods, "policyTypes": ["Ingress"], "ingress": ingress},
    }


def render_network_policies(
    body: dict[str, Any], config: OperatorConfig = DEFAULT_CONFIG
) -> list[dict[str, Any]]:
    """Ingress rules for the AtomDeployment's pods, [] when spec.networkPolicy.enabled is false.

    `<name>` over the engine pods:
    - HTTP (8000): from anywhere without a router (clients come through the Service); with a
      router only from this deployment's pods, the operator (`config.operator_peer`, its
      /metrics scrape) and spec.networkPolicy.httpFrom, so clients cannot bypass the router;
    - KV events and replay: only from the router and spec.networkPolicy.kvEventsFrom;
    - in disaggregated mode, every other TCP port (the KV-transfer connector's) only from this
      deployment's engine pods.
    `<name>-router` over the router pods: its HTTP port from anywhere, nothing else.
    """
    spec = defaulted_spec(body)
    if not spec["networkPolicy"]["enabled"]:
        return []
    policies = [_policy(body, child_name(body), _engine_pods(body), _engine_ingress(body, config))]
    if has_router(spec):
        router_pods = {"matchLabels": role_selector(body, ROUTER)}
        policies.append(
            _policy(
                body, child_name(body, ROUTER), router_pods, [{"ports": _tcp(ENGINE_HTTP_PORT)}]
            )
        )
    return policies


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

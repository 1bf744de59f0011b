"""The router (`atom router`) in front of the engine pods: its Deployment, arguments, and the
ServiceAccount, Role and RoleBinding of its EndpointSlice watch."""

from __future__ import annotations

import copy
from typing import Any

from atom_operator.render.container import (
    bounded_resources,
    container_security,
    http_probe,
    pod_security,
    tmp_volume_and_mount,
)
from atom_operator.render.keys import KEYS_MOUNT, keys_volume, transfer_key_env
from atom_operator.render.kubelet_expansion import reference
from atom_operator.render.names import (
    ROUTER,
    child_metadata,
    child_name,
    defaulted_spec,
    is_disaggregated,
    namespace_of,
    role_labels,
    role_selector,
    service_host,
)
from atom_operator.schema import ENGINE_HTTP_PORT
from atom_operator.spec import has_router

# What the router's EndpointSlice watch needs (runtime/atom_runtime/router/discovery.py): the
# operator grants exactly this to the router's ServiceAccount, in the AtomDeployment's namespace,
# and must hold it itself (Kubernetes refuses to create a Role granting more than its creator has).
ROUTER_RULES = [
    {
        "apiGroups": ["discovery.k8s.io"],
        "resources": ["endpointslices"],
        "verbs": ["get", "list", "watch"],
    }
]

DEFAULT_ROUTER_RESOURCES = {"cpu": "1", "memory": "1Gi"}
ROUTER_API_KEY_ENV = "ATOM_ROUTER_API_KEY"


def router_args(body: dict[str, Any]) -> list[str]:
    """`atom router` arguments: where the decode pods are, and the prefill pods in
    disaggregated mode (their headless Services; an aggregated router gets --decode-service
    alone), and the ports of the decode pods' KV-event PUB and replay sockets (spec.kvEvents),
    0 for both when KV events are disabled so the router subscribes to none; with CurveZMQ
    KV events the directory of the deployment's keys, and with router.apiKeySecret its own
    --api-key (expanded by the kubelet from a Secret-backed variable)."""
    spec = defaulted_spec(body)

    def url(role: str) -> str:
        return f"http://{service_host(body, child_name(body, role))}:{ENGINE_HTTP_PORT}"

    events = spec["kvEvents"]
    enabled = events["enabled"]
    services = ["--decode-service", url("decode")]
    if is_disaggregated(spec):
        services += ["--prefill-service", url("prefill")]
    args = [
        "router",
        "--host", "0.0.0.0",
        "--port", str(ENGINE_HTTP_PORT),
        *services,
        "--kv-events-port", str(events["port"] if enabled else 0),
        "--kv-events-replay-port", str(events["replayPort"] if enabled else 0),
    ]  # fmt: skip
    if enabled and events["encryption"] == "curve":
        args += ["--kv-events-curve-dir", KEYS_MOUNT]
    if spec["router"].get("apiKeySecret"):
        args += ["--api-key", reference(ROUTER_API_KEY_ENV)]
    return args


def router_env(spec: dict[str, Any]) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [transfer_key_env()]
    secret = spec["router"].get("apiKeySecret")
    if secret:
        ref = {"name": secret["name"], "key": secret["key"]}
        env.append({"name": ROUTER_API_KEY_ENV, "valueFrom": {"secretKeyRef": ref}})
    return env


def router_service_account_name(body: dict[str, Any]) -> str:
    """The router's ServiceAccount, Role and RoleBinding share the router Deployment's name."""
    return child_name(body, ROUTER)


def render_router_rbac(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The router's ServiceAccount, a Role allowing ROUTER_RULES in the AtomDeployment's
    namespace and the RoleBinding between them; [] when there is no router."""
    spec = defaulted_spec(body)
    if not has_router(spec):
        return []
    name = router_service_account_name(body)
    labels = role_labels(body, ROUTER)
    account: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": child_metadata(body, name, labels),
        # Only the router pod mounts the token (its pod spec asks for it explicitly).
        "automountServiceAccountToken": False,
    }
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": child_metadata(body, name, labels),
        "rules": copy.deepcopy(ROUTER_RULES),
    }
    subject: dict[str, Any] = {"kind": "ServiceAccount", "name": name}
    if namespace_of(body):
        subject["namespace"] = namespace_of(body)
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": child_metadata(body, name, labels),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [subject],
    }
    return [account, role, binding]


def render_router_deployment(body: dict[str, Any]) -> dict[str, Any] | None:
    """The router Deployment (`atom router`), or None when spec.router.enabled is false."""
    spec = defaulted_spec(body)
    if not has_router(spec):
        return None
    router = spec["router"]
    labels = role_labels(body, ROUTER)
    tmp_volume, tmp_mount = tmp_volume_and_mount()
    keys, keys_mount = keys_volume(body)
    container = {
        "name": ROUTER,
        "image": router["image"],
        "imagePullPolicy": spec["engine"]["imagePullPolicy"],
        "command": ["atom"],
        "args": router_args(body),
        "env": router_env(spec),
        "ports": [{"name": "http", "containerPort": ENGINE_HTTP_PORT, "protocol": "TCP"}],
        "resources": bounded_resources(router["resources"], DEFAULT_ROUTER_RESOURCES),
        "volumeMounts": [tmp_mount, keys_mount],
        "readinessProbe": http_probe(5, 5, 3),
        "livenessProbe": http_probe(15, 10, 4),
        "securityContext": container_security(),
    }
    pod: dict[str, Any] = {
        "securityContext": pod_security([]),
        "enableServiceLinks": False,
        # The router watches EndpointSlices (render_router_rbac): the one pod with a token.
        "serviceAccountName": router_service_account_name(body),
        "automountServiceAccountToken": True,
        "containers": [container],
        "volumes": [tmp_volume, keys],
    }
    if spec["engine"]["imagePullSecrets"]:
        pod["imagePullSecrets"] = copy.deepcopy(spec["engine"]["imagePullSecrets"])
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": child_metadata(body, child_name(body, ROUTER), labels),
        "spec": {
            "replicas": router["replicas"],
            "selector": {"matchLabels": role_selector(body, ROUTER)},
            "template": {"metadata": {"labels": labels}, "spec": pod},
        },
    }

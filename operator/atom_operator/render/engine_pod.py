"""The engine pod of a role: its container (args, env, ports, resources, probes), volumes,
security and placement."""

from __future__ import annotations

import copy
import math
from typing import Any

from atom_operator.render.container import (
    bounded_resources,
    container_security,
    http_probe,
    pod_security,
    tmp_volume_and_mount,
)
from atom_operator.render.engine_args import (
    API_KEY_ENV,
    COMPILE_CACHE_DIR,
    POD_IP_ENV,
    serve_args,
)
from atom_operator.render.keys import keys_volume, transfer_key_env
from atom_operator.render.kubelet_expansion import literal
from atom_operator.render.model_volume import download_container, model_mount, model_volume
from atom_operator.render.names import ENGINE_CONTAINER, defaulted_spec
from atom_operator.schema import ENGINE_HTTP_PORT
from atom_operator.spec import RESERVED_ENV, vendor_resource

CACHE_DIR = "/var/cache/atom"
# CPU and memory every container gets when the spec leaves them out (request = limit).
DEFAULT_ENGINE_RESOURCES = {
    "cpu": {"cpu": "2", "memory": "4Gi"},
    "gpu": {"cpu": "8", "memory": "64Gi"},
}
STARTUP_PROBE_PERIOD = 10
COMPILE_CACHE_VOLUME = "compile-cache"


def _user_variable(var: dict[str, Any]) -> dict[str, Any]:
    """A user's env entry as rendered: its `value` escaped for the kubelet (kept literally)."""
    out = copy.deepcopy(var)
    if isinstance(out.get("value"), str):
        out["value"] = literal(out["value"])
    return out


def _merge_env(base: list[dict[str, Any]], extra: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`base` with each user variable of `extra` replacing the one of the same name, or
    appended."""
    merged = [copy.deepcopy(var) for var in base]
    for var in extra:
        if var["name"] in RESERVED_ENV:
            continue  # validate_spec refuses these; never let one break the KV-event topic
        for index, existing in enumerate(merged):
            if existing["name"] == var["name"]:
                merged[index] = _user_variable(var)
                break
        else:
            merged.append(_user_variable(var))
    return merged


def engine_env(spec: dict[str, Any], role: str) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        transfer_key_env(),
    ]
    secret = spec["model"].get("authSecretRef")
    if secret:
        env.append(
            {
                "name": "HF_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": secret["name"], "key": secret["key"]}},
            }
        )
    api_key = spec["engine"].get("apiKeySecretRef")
    if api_key:
        env.append(
            {
                "name": API_KEY_ENV,
                "valueFrom": {"secretKeyRef": {"name": api_key["name"], "key": api_key["key"]}},
            }
        )
    env += [
        {"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"},
        # Triton's cache on the compile-cache volume, which outlives the container (and, with a
        # claim, the pod); the runtime's --compile-cache-dir keeps its own results beside it.
        {"name": "TRITON_CACHE_DIR", "value": f"{COMPILE_CACHE_DIR}/triton"},
        # Anything else that caches under ~/.cache (torch hub, ...) on the writable volume.
        {"name": "XDG_CACHE_HOME", "value": f"{CACHE_DIR}/xdg"},
    ]
    return _merge_env(_merge_env(env, spec["engine"]["env"]), spec[role]["env"])


def engine_resources(spec: dict[str, Any], role: str) -> dict[str, Any]:
    """The role's resources, bounded (`bounded_resources`), with the accelerator resource =
    tensorParallelSize (limit and request)."""
    kind = "cpu" if spec["accelerator"]["vendor"] == "cpu" else "gpu"
    resources = bounded_resources(spec[role]["resources"], DEFAULT_ENGINE_RESOURCES[kind])
    resource = vendor_resource(spec["accelerator"])
    if resource:
        count = spec[role]["tensorParallelSize"]
        resources.setdefault("limits", {})[resource] = count
        resources.setdefault("requests", {})[resource] = count
    return resources


def engine_ports(spec: dict[str, Any]) -> list[dict[str, Any]]:
    ports = [{"name": "http", "containerPort": ENGINE_HTTP_PORT, "protocol": "TCP"}]
    events = spec["kvEvents"]
    if events["enabled"]:
        ports += [
            {"name": "kv-events", "containerPort": events["port"], "protocol": "TCP"},
            {"name": "kv-replay", "containerPort": events["replayPort"], "protocol": "TCP"},
        ]
    return ports


def _node_affinity(spec: dict[str, Any]) -> dict[str, Any] | None:
    product = spec["accelerator"].get("productLabels")
    if not product:
        return None
    requirement = {"key": product["key"], "operator": "In", "values": list(product["values"])}
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [requirement]}]
            }
        }
    }


def compile_cache_volume(spec: dict[str, Any]) -> dict[str, Any]:
    """spec.engine.compileCache: a claim shared by the replicas, else a size-limited emptyDir."""
    cache = spec["engine"]["compileCache"]
    if "pvc" in cache:
        claim = {"claimName": cache["pvc"]["claimName"]}
        return {"name": COMPILE_CACHE_VOLUME, "persistentVolumeClaim": claim}
    return {"name": COMPILE_CACHE_VOLUME, "emptyDir": {"sizeLimit": cache["sizeLimit"]}}


def _engine_volumes(
    body: dict[str, Any], spec: dict[str, Any]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    tmp_volume, tmp_mount = tmp_volume_and_mount()
    keys_volume_, keys_mount = keys_volume(body)
    volumes: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec["engine"]["shmSize"]}},
        {"name": "cache", "emptyDir": {"sizeLimit": spec["engine"]["cacheSize"]}},
        compile_cache_volume(spec),
        tmp_volume,
        keys_volume_,
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "cache", "mountPath": CACHE_DIR},
        # Inside /var/cache/atom, mounted after it.
        {"name": COMPILE_CACHE_VOLUME, "mountPath": COMPILE_CACHE_DIR},
        tmp_mount,
        keys_mount,
    ]
    volume = model_volume(body, spec)
    if volume is not None:
        volumes.append(volume)
        mounts.append(model_mount())
    return volumes, mounts


def engine_pod_spec(body: dict[str, Any], role: str) -> dict[str, Any]:
    """The pod template's spec for one engine role of the AtomDeployment `body`."""
    spec = defaulted_spec(body)
    engine = spec["engine"]
    accelerator = spec["accelerator"]
    volumes, mounts = _engine_volumes(body, spec)
    _, tmp_mount = tmp_volume_and_mount()
    download = download_container(body, spec, tmp_mount)
    startup_failures = math.ceil(engine["startupTimeoutSeconds"] / STARTUP_PROBE_PERIOD)
    container = {
        "name": ENGINE_CONTAINER,
        "image": engine["image"],
        "imagePullPolicy": engine["imagePullPolicy"],
        "command": ["atom"],
        "args": serve_args(spec, role),
        "env": engine_env(spec, role),
        "ports": engine_ports(spec),
        "resources": engine_resources(spec, role),
        "volumeMounts": mounts,
        "startupProbe": http_probe(STARTUP_PROBE_PERIOD, 5, startup_failures),
        "readinessProbe": http_probe(5, 5, 3),
        "livenessProbe": http_probe(15, 10, 4),
        "securityContext": container_security(),
    }
    pod: dict[str, Any] = {
        "securityContext": pod_security(accelerator["supplementalGroups"]),
        "enableServiceLinks": False,
        # The engine never calls the Kubernetes API: no token to steal from a compromised pod.
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": 60,
        "containers": [container],
        "volumes": volumes,
    }
    if download is not None:
        pod["initContainers"] = [download]
    if engine["imagePullSecrets"]:
        pod["imagePullSecrets"] = copy.deepcopy(engine["imagePullSecrets"])
    affinity = _node_affinity(spec)
    if affinity:
        pod["affinity"] = affinity
    if accelerator["nodeSelector"]:
        pod["nodeSelector"] = dict(accelerator["nodeSelector"])
    if accelerator["tolerations"]:
        pod["tolerations"] = copy.deepcopy(accelerator["tolerations"])
    return pod

"""What every container and pod the operator renders shares: probes, security contexts, a
writable /tmp, bounded CPU and memory."""

from __future__ import annotations

import copy
from typing import Any

RUN_AS_USER = 1000  # the `atom` user of docker/runtime.Dockerfile
TMP_SIZE = "1Gi"


def bounded_resources(resources: dict[str, Any], default: dict[str, str]) -> dict[str, Any]:
    """`resources` with a request and a limit for both cpu and memory: a missing limit takes
    the request, a missing request the limit (as Kubernetes would), both missing `default`."""
    out = copy.deepcopy(resources)
    requests, limits = out.setdefault("requests", {}), out.setdefault("limits", {})
    for name in ("cpu", "memory"):
        request = requests.get(name, limits.get(name, default[name]))
        requests[name] = request
        limits.setdefault(name, request)
    return out


def http_probe(period: int, timeout: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": "/health", "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
    }


def container_security() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def tmp_volume_and_mount() -> tuple[dict[str, Any], dict[str, Any]]:
    """A small writable /tmp: Python, torch and Triton write temporary files there."""
    return (
        {"name": "tmp", "emptyDir": {"sizeLimit": TMP_SIZE}},
        {"name": "tmp", "mountPath": "/tmp"},
    )


def pod_security(supplemental_groups: list[int]) -> dict[str, Any]:
    context: dict[str, Any] = {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "fsGroup": RUN_AS_USER,
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    if supplemental_groups:
        context["supplementalGroups"] = list(supplemental_groups)
    return context

"""Render an AtomDeployment into the Kubernetes objects that serve it. Pure functions, no I/O.

`render_children(body)` is the entry point the kopf handlers and `atom render` call: it validates
the spec (raising `SpecError`), fills defaults and returns every child object, each owned by the
AtomDeployment when `metadata.uid` is known:

- per role (decode, and prefill in disaggregated mode): a Deployment running `atom serve`, a
  headless Service (per-pod DNS for the router and KV-event subscribers), a PodDisruptionBudget,
  and, when the role autoscales, an autoscaling/v2 HorizontalPodAutoscaler (provider hpa) or a
  KEDA ScaledObject (provider keda); provider builtin renders nothing (the operator scales);
- when the router is on (spec.router.enabled: always in disaggregated mode, opt-in when
  aggregated), a router Deployment running `atom router`, with its own ServiceAccount, Role and
  RoleBinding (list/watch on the namespace's EndpointSlices, for its discovery);
- a Gateway API Inference Extension InferencePool over the serving pods, when
  spec.inferencePool.enabled;
- a NetworkPolicy over every pod of the AtomDeployment (unless spec.networkPolicy.enabled is
  false);
- the user-facing Service, in front of the router when there is one, else of the decode pods.

Every container runs with a read-only root filesystem (writable, size-limited emptyDirs for the
cache, /tmp and /dev/shm) and CPU and memory requests and limits; engine pods get no service
account token (only the router's pod mounts one, for its EndpointSlice watch).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import re
from typing import Any

from atom_operator.schema import API_VERSION, ENGINE_HTTP_PORT, KIND
from atom_operator.spec import (
    RESERVED_ENV,
    ROLES,
    SpecError,
    apply_defaults,
    has_router,
    parse_model_uri,
    validate_spec,
    vendor_resource,
)

# Kinds render_children may produce, as (apiVersion, kind, plural): what the operator lists by
# the `serving.atom.dev/deployment` label to prune children a new spec no longer renders.
CHILD_KINDS = [
    ("apps/v1", "Deployment", "deployments"),
    ("v1", "Service", "services"),
    ("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets"),
    ("autoscaling/v2", "HorizontalPodAutoscaler", "horizontalpodautoscalers"),
    ("keda.sh/v1alpha1", "ScaledObject", "scaledobjects"),
    ("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies"),
    ("inference.networking.k8s.io/v1", "InferencePool", "inferencepools"),
    ("v1", "ServiceAccount", "serviceaccounts"),
    ("rbac.authorization.k8s.io/v1", "Role", "roles"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings"),
]

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

ROUTER = "router"
DEPLOYMENT_LABEL = "serving.atom.dev/deployment"
ROLE_LABEL = "serving.atom.dev/role"
ENGINE_CONTAINER = "engine"
ENGINE_TYPE = "atom"  # llm-d.ai/engine-type: our metrics carry the atom: prefix, not vllm:

# Custom-metrics names of the engine's gauges as the Prometheus adapter exposes them (the adapter
# rule in docs/operator.md renames atom:<x> to atom_<x>).
METRIC_REQUESTS_WAITING = "atom_requests_waiting"
METRIC_KV_CACHE_USAGE = "atom_kv_cache_usage_ratio"
METRIC_REQUESTS_RUNNING = "atom_requests_running"
KEDA_POLLING_SECONDS = 15

RUN_AS_USER = 1000  # the `atom` user of docker/runtime.Dockerfile
CACHE_DIR = "/var/cache/atom"
TMP_SIZE = "1Gi"
API_KEY_ENV = "ATOM_API_KEY"
# CPU and memory every container gets when the spec leaves them out (request = limit).
DEFAULT_ENGINE_RESOURCES = {
    "cpu": {"cpu": "2", "memory": "4Gi"},
    "gpu": {"cpu": "8", "memory": "64Gi"},
}
DEFAULT_ROUTER_RESOURCES = {"cpu": "1", "memory": "1Gi"}
MODEL_MOUNT = "/mnt/models"
STARTUP_PROBE_PERIOD = 10

_MAX_NAME = 63
_HASH_LEN = 8


# --- names and labels -------------------------------------------------------------------------


def _short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:_HASH_LEN]


def child_name(body: dict[str, Any], suffix: str = "") -> str:
    """A DNS-1035 label (<= 63 chars, [a-z0-9-], starts with a letter) for a child object.

    `<name>-<suffix>` when the AtomDeployment's name is already such a label and the result fits;
    otherwise the sanitized, truncated name, a hash of the original name, then the suffix, so
    two AtomDeployments whose names sanitize alike still get distinct children.
    """
    name = body["metadata"]["name"]
    tail = f"-{suffix}" if suffix else ""
    clean = re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", name.lower())).strip("-")
    if clean[:1].isalpha() and clean == name and len(clean) + len(tail) <= _MAX_NAME:
        return clean + tail
    if not clean[:1].isalpha():
        clean = f"atom-{clean}".rstrip("-")
    room = _MAX_NAME - len(tail) - _HASH_LEN - 1
    base = clean[:room].rstrip("-")
    return f"{base}-{_short_hash(name)}{tail}"


def label_value(text: str) -> str:
    """`text` as a label value: kept when valid, else truncated to 63 chars with a hash."""
    if len(text) <= _MAX_NAME and re.fullmatch(
        r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?", text
    ):
        return text
    clean = re.sub(r"[^A-Za-z0-9_.-]", "-", text)
    base = clean[: _MAX_NAME - _HASH_LEN - 1].strip("-_.")
    return f"{base}-{_short_hash(text)}"


def _name(body: dict[str, Any]) -> str:
    return body["metadata"]["name"]


def _namespace(body: dict[str, Any]) -> str | None:
    return body["metadata"].get("namespace")


def role_selector(body: dict[str, Any], role: str) -> dict[str, str]:
    """matchLabels of one role's pods (decode, prefill or router); immutable once created."""
    return {DEPLOYMENT_LABEL: label_value(_name(body)), ROLE_LABEL: role}


def role_selector_string(body: dict[str, Any], role: str) -> str:
    """The same selector as a string, for status.roles.<role>.selector (the scale subresource)."""
    return ",".join(f"{key}={value}" for key, value in role_selector(body, role).items())


def common_labels(body: dict[str, Any]) -> dict[str, str]:
    """Labels on every child; `serving.atom.dev/deployment` finds them all for pruning."""
    instance = label_value(_name(body))
    return {
        "app.kubernetes.io/name": "atom",
        "app.kubernetes.io/instance": instance,
        "app.kubernetes.io/managed-by": "atom-operator",
        DEPLOYMENT_LABEL: instance,
    }


def role_labels(body: dict[str, Any], role: str) -> dict[str, str]:
    labels = common_labels(body)
    labels["app.kubernetes.io/component"] = role
    labels[ROLE_LABEL] = role
    if role in ROLES:
        # llm-d's inference scheduler selects serving pods and their P/D role by these.
        labels["llm-d.ai/inferenceServing"] = "true"
        labels["llm-d.ai/role"] = role
        labels["llm-d.ai/engine-type"] = ENGINE_TYPE
    return labels


def owner_references(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The controller reference to the AtomDeployment; empty before it has a uid."""
    uid = body["metadata"].get("uid")
    if not uid:
        return []
    return [
        {
            "apiVersion": body.get("apiVersion", API_VERSION),
            "kind": body.get("kind", KIND),
            "name": _name(body),
            "uid": uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]


def _metadata(body: dict[str, Any], name: str, labels: dict[str, str]) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name}
    if _namespace(body):
        metadata["namespace"] = _namespace(body)
    metadata["labels"] = labels
    owners = owner_references(body)
    if owners:
        metadata["ownerReferences"] = owners
    return metadata


def _spec(body: dict[str, Any]) -> dict[str, Any]:
    return apply_defaults(body.get("spec") or {})


def service_host(body: dict[str, Any], service: str) -> str:
    return f"{service}.{_namespace(body) or 'default'}.svc.cluster.local"


def endpoint_url(body: dict[str, Any]) -> str:
    """The OpenAI base URL of the user-facing Service, from inside the cluster."""
    port = _spec(body)["service"]["port"]
    return f"http://{service_host(body, child_name(body))}:{port}/v1"


def is_disaggregated(spec: dict[str, Any]) -> bool:
    return "prefill" in spec


# --- the engine container ---------------------------------------------------------------------


def _json_arg(value: dict[str, Any]) -> str:
    return json.dumps(value, separators=(",", ":"))


def kv_events_config(spec: dict[str, Any]) -> dict[str, Any]:
    """--kv-events-config: bind PUB and replay sockets; the topic names this pod and model."""
    events = spec["kvEvents"]
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{events['port']}",
        "replay_endpoint": f"tcp://*:{events['replayPort']}",
        # $(POD_IP) is expanded by the kubelet from the container's POD_IP variable.
        "topic": f"kv@$(POD_IP):{events['port']}@{spec['model']['name']}",
    }


def kv_transfer_config(spec: dict[str, Any], role: str) -> dict[str, Any]:
    """--kv-transfer-config: prefill produces KV, decode consumes it."""
    transfer = spec["kvTransfer"]
    return {
        "kv_connector": transfer["connector"],
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "kv_connector_extra_config": transfer["config"],
    }


def model_argument(spec: dict[str, Any]) -> str | None:
    """What `--model` gets: the hf repo id, the mounted claim path, the image path, or None."""
    source = parse_model_uri(spec["model"].get("uri"))
    if source.scheme == "hf":
        return source.repo_id
    if source.scheme == "pvc":
        return f"{MODEL_MOUNT}/{source.path}" if source.path else MODEL_MOUNT
    if source.scheme == "file":
        return source.path
    return None


def serve_args(spec: dict[str, Any], role: str) -> list[str]:
    """`atom serve` arguments for one role of a defaulted spec; user args come last and win."""
    role_spec = spec[role]
    args = ["serve", "--host", "0.0.0.0", "--port", str(ENGINE_HTTP_PORT)]
    model = model_argument(spec)
    if model is not None:
        args += ["--model", model]
    args += ["--served-model-name", spec["model"]["name"]]
    args += ["--block-size", str(spec["engine"]["blockSize"])]
    if "maxModelLen" in spec["engine"]:
        args += ["--max-model-len", str(spec["engine"]["maxModelLen"])]
    args += ["--tensor-parallel-size", str(role_spec["tensorParallelSize"])]
    if spec["kvEvents"]["enabled"]:
        args += ["--kv-events-config", _json_arg(kv_events_config(spec))]
    checkpoint = spec["stateCheckpoint"]
    args += ["--state-checkpoint-interval-tokens", str(checkpoint["intervalTokens"])]
    args.append(
        "--state-checkpoint-demand" if checkpoint["demand"] else "--no-state-checkpoint-demand"
    )
    args += ["--state-checkpoint-memory-fraction", f"{checkpoint['memoryFraction']:g}"]
    if is_disaggregated(spec):
        args += ["--kv-transfer-config", _json_arg(kv_transfer_config(spec, role))]
    if spec["engine"].get("apiKeySecretRef"):
        # The kubelet expands $(ATOM_API_KEY) from the Secret-backed variable: the key never
        # appears in the pod spec.
        args += ["--api-key", f"$({API_KEY_ENV})"]
    return args + list(spec["engine"]["args"]) + list(role_spec["args"])


def _merge_env(base: list[dict[str, Any]], extra: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`base` with each variable of `extra` replacing the one of the same name, or appended."""
    merged = [copy.deepcopy(var) for var in base]
    for var in extra:
        if var["name"] in RESERVED_ENV:
            continue  # validate_spec refuses these; never let one break the KV-event topic
        for index, existing in enumerate(merged):
            if existing["name"] == var["name"]:
                merged[index] = copy.deepcopy(var)
                break
        else:
            merged.append(copy.deepcopy(var))
    return merged


def engine_env(spec: dict[str, Any], role: str) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
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
        {"name": "TRITON_CACHE_DIR", "value": f"{CACHE_DIR}/triton"},
        # Anything else that caches under ~/.cache (torch hub, ...) on the writable volume.
        {"name": "XDG_CACHE_HOME", "value": f"{CACHE_DIR}/xdg"},
    ]
    return _merge_env(_merge_env(env, spec["engine"]["env"]), spec[role]["env"])


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


def _http_probe(period: int, timeout: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": "/health", "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
    }


def _container_security() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _tmp_volume() -> tuple[dict[str, Any], dict[str, Any]]:
    """A small writable /tmp: Python, torch and Triton write temporary files there."""
    return (
        {"name": "tmp", "emptyDir": {"sizeLimit": TMP_SIZE}},
        {"name": "tmp", "mountPath": "/tmp"},
    )


def _pod_security(supplemental_groups: list[int]) -> dict[str, Any]:
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


def _engine_volumes(spec: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    tmp_volume, tmp_mount = _tmp_volume()
    volumes: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec["engine"]["shmSize"]}},
        {"name": "cache", "emptyDir": {"sizeLimit": spec["engine"]["cacheSize"]}},
        tmp_volume,
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "cache", "mountPath": CACHE_DIR},
        tmp_mount,
    ]
    source = parse_model_uri(spec["model"].get("uri"))
    if source.scheme == "pvc":
        volumes.append(
            {
                "name": "model",
                "persistentVolumeClaim": {"claimName": source.claim, "readOnly": True},
            }
        )
        mounts.append({"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True})
    return volumes, mounts


def _engine_pod_spec(spec: dict[str, Any], role: str) -> dict[str, Any]:
    engine = spec["engine"]
    accelerator = spec["accelerator"]
    volumes, mounts = _engine_volumes(spec)
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
        "startupProbe": _http_probe(STARTUP_PROBE_PERIOD, 5, startup_failures),
        "readinessProbe": _http_probe(5, 5, 3),
        "livenessProbe": _http_probe(15, 10, 4),
        "securityContext": _container_security(),
    }
    pod: dict[str, Any] = {
        "securityContext": _pod_security(accelerator["supplementalGroups"]),
        "enableServiceLinks": False,
        # The engine never calls the Kubernetes API: no token to steal from a compromised pod.
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": 60,
        "containers": [container],
        "volumes": volumes,
    }
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


# --- children ---------------------------------------------------------------------------------


def render_role_deployment(body: dict[str, Any], role: str) -> dict[str, Any]:
    """The Deployment of one role; without `replicas` when the role autoscales (the HPA owns it)."""
    spec = _spec(body)
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
                    "annotations": {"kubectl.kubernetes.io/default-container": ENGINE_CONTAINER},
                },
                "spec": _engine_pod_spec(spec, role),
            },
        }
    )
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(body, child_name(body, role), labels),
        "spec": deployment_spec,
    }


def render_role_service(body: dict[str, Any], role: str) -> dict[str, Any]:
    """A headless Service per role: per-pod DNS records for the router and KV-event consumers."""
    spec = _spec(body)
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
        "metadata": _metadata(body, child_name(body, role), role_labels(body, role)),
        "spec": {
            "clusterIP": "None",
            "selector": role_selector(body, role),
            "ports": ports,
        },
    }


def render_service(body: dict[str, Any]) -> dict[str, Any]:
    """The user-facing Service: the router when there is one, else the decode pods."""
    spec = _spec(body)
    service = spec["service"]
    target = ROUTER if has_router(spec) else "decode"
    metadata = _metadata(body, child_name(body), common_labels(body))
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
        "metadata": _metadata(body, child_name(body, role), role_labels(body, role)),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": role_selector(body, role)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


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
    spec = _spec(body)
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
        "metadata": _metadata(body, child_name(body, role), role_labels(body, role)),
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
    spec = _spec(body)
    autoscaling = spec[role]["autoscaling"]
    if autoscaler(spec, role) != "keda":
        return None
    address = autoscaling["keda"]["serverAddress"]
    namespace = _namespace(body) or "default"
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
        "metadata": _metadata(body, child_name(body, role), role_labels(body, role)),
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


def router_args(body: dict[str, Any]) -> list[str]:
    """`atom router` arguments: where the decode pods are, and the prefill pods in
    disaggregated mode (their headless Services; an aggregated router gets --decode-service
    alone), and the ports of the decode pods' KV-event PUB and replay sockets (spec.kvEvents),
    0 for both when KV events are disabled so the router subscribes to none."""
    spec = _spec(body)

    def url(role: str) -> str:
        return f"http://{service_host(body, child_name(body, role))}:{ENGINE_HTTP_PORT}"

    events = spec["kvEvents"]
    enabled = events["enabled"]
    services = ["--decode-service", url("decode")]
    if is_disaggregated(spec):
        services += ["--prefill-service", url("prefill")]
    return [
        "router",
        "--host", "0.0.0.0",
        "--port", str(ENGINE_HTTP_PORT),
        *services,
        "--kv-events-port", str(events["port"] if enabled else 0),
        "--kv-events-replay-port", str(events["replayPort"] if enabled else 0),
    ]  # fmt: skip


def router_service_account_name(body: dict[str, Any]) -> str:
    """The router's ServiceAccount, Role and RoleBinding share the router Deployment's name."""
    return child_name(body, ROUTER)


def render_router_rbac(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The router's ServiceAccount, a Role allowing ROUTER_RULES in the AtomDeployment's
    namespace and the RoleBinding between them; [] when there is no router."""
    spec = _spec(body)
    if not has_router(spec):
        return []
    name = router_service_account_name(body)
    labels = role_labels(body, ROUTER)
    account: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _metadata(body, name, labels),
        # Only the router pod mounts the token (its pod spec asks for it explicitly).
        "automountServiceAccountToken": False,
    }
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _metadata(body, name, labels),
        "rules": copy.deepcopy(ROUTER_RULES),
    }
    subject: dict[str, Any] = {"kind": "ServiceAccount", "name": name}
    if _namespace(body):
        subject["namespace"] = _namespace(body)
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _metadata(body, name, labels),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [subject],
    }
    return [account, role, binding]


def render_router_deployment(body: dict[str, Any]) -> dict[str, Any] | None:
    """The router Deployment (`atom router`), or None when spec.router.enabled is false."""
    spec = _spec(body)
    if not has_router(spec):
        return None
    router = spec["router"]
    labels = role_labels(body, ROUTER)
    tmp_volume, tmp_mount = _tmp_volume()
    container = {
        "name": ROUTER,
        "image": router["image"],
        "imagePullPolicy": spec["engine"]["imagePullPolicy"],
        "command": ["atom"],
        "args": router_args(body),
        "ports": [{"name": "http", "containerPort": ENGINE_HTTP_PORT, "protocol": "TCP"}],
        "resources": bounded_resources(router["resources"], DEFAULT_ROUTER_RESOURCES),
        "volumeMounts": [tmp_mount],
        "readinessProbe": _http_probe(5, 5, 3),
        "livenessProbe": _http_probe(15, 10, 4),
        "securityContext": _container_security(),
    }
    pod: dict[str, Any] = {
        "securityContext": _pod_security([]),
        "enableServiceLinks": False,
        # The router watches EndpointSlices (render_router_rbac): the one pod with a token.
        "serviceAccountName": router_service_account_name(body),
        "automountServiceAccountToken": True,
        "containers": [container],
        "volumes": [tmp_volume],
    }
    if spec["engine"]["imagePullSecrets"]:
        pod["imagePullSecrets"] = copy.deepcopy(spec["engine"]["imagePullSecrets"])
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(body, child_name(body, ROUTER), labels),
        "spec": {
            "replicas": router["replicas"],
            "selector": {"matchLabels": role_selector(body, ROUTER)},
            "template": {"metadata": {"labels": labels}, "spec": pod},
        },
    }


def render_network_policy(body: dict[str, Any]) -> dict[str, Any] | None:
    """Ingress to every pod of the AtomDeployment: the HTTP port from anywhere (clients come
    through the Service, the operator scrapes /metrics); everything else (KV events, replay, KV
    transfer) only from pods of the same AtomDeployment and from spec.networkPolicy.kvEventsFrom
    on the KV-event ports. None when spec.networkPolicy.enabled is false."""
    spec = _spec(body)
    policy = spec["networkPolicy"]
    if not policy["enabled"]:
        return None
    own_pods = {"podSelector": {"matchLabels": {DEPLOYMENT_LABEL: label_value(_name(body))}}}
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
        "metadata": _metadata(body, child_name(body), common_labels(body)),
        "spec": {
            "podSelector": {"matchLabels": {DEPLOYMENT_LABEL: label_value(_name(body))}},
            "policyTypes": ["Ingress"],
            "ingress": rules,
        },
    }


def render_inference_pool(body: dict[str, Any]) -> dict[str, Any] | None:
    """An InferencePool (inference.networking.k8s.io/v1) over every pod that serves requests
    (the engine roles, not the router: llm-d's endpoint picker tells prefill from decode by the
    llm-d.ai/role label), or None unless spec.inferencePool.enabled."""
    spec = _spec(body)
    pool = spec["inferencePool"]
    if not pool["enabled"]:
        return None
    picker = pool["endpointPicker"]
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": _metadata(body, child_name(body), common_labels(body)),
        "spec": {
            "selector": {
                "matchLabels": {
                    DEPLOYMENT_LABEL: label_value(_name(body)),
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


def render_children(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Validate the AtomDeployment `body` and return every child object (raises SpecError)."""
    if not isinstance(body.get("metadata"), dict) or not body["metadata"].get("name"):
        raise SpecError("metadata.name", "is required")
    validate_spec(body.get("spec") or {})
    spec = _spec(body)
    children: list[dict[str, Any]] = []
    for role in ROLES:
        if role not in spec:
            continue
        children += [
            render_role_deployment(body, role),
            render_role_service(body, role),
            render_pdb(body, role),
        ]
        for scaler in (render_hpa(body, role), render_scaled_object(body, role)):
            if scaler is not None:
                children.append(scaler)
    children += render_router_rbac(body)
    extras = (render_router_deployment(body), render_inference_pool(body),
              render_network_policy(body))  # fmt: skip
    for extra in extras:
        if extra is not None:
            children.append(extra)
    children.append(render_service(body))
    return children

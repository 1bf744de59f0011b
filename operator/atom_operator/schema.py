"""The AtomDeployment API: its OpenAPI v3 schema, CEL rules and CustomResourceDefinition.

This module is the one place the API's fields, bounds and static defaults are written down.
`crds/atomdeployments.serving.atom.dev.yaml` is generated from `crd()` (run
`python -m atom_operator.schema > crds/atomdeployments.serving.atom.dev.yaml`; a test fails when the
committed file drifts), and `atom_operator.spec` walks the same `SPEC_SCHEMA` to default and
validate a spec in Python, so the API server and the operator apply the same rules.

Defaults that depend on another field (the engine image on the vendor, the tolerations on the
vendor, ...) cannot be expressed in a CRD; they live in `atom_operator.spec.DERIVED_DEFAULTS`.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import yaml

GROUP = "serving.atom.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "AtomDeployment"
PLURAL = "atomdeployments"
SINGULAR = "atomdeployment"
SHORT_NAMES = ["atomd"]
CRD_NAME = f"{PLURAL}.{GROUP}"

# The engine's HTTP port inside the pod; kvEvents ports must not collide with it.
ENGINE_HTTP_PORT = 8000

# hf://<org>/<repo>, pvc://<claim>[/<path>], file:///<absolute path in the image>.
MODEL_URI_PATTERN = (
    r"^(hf://[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*"
    r"|pvc://[a-z0-9]([-a-z0-9.]*[a-z0-9])?(/.*)?"
    r"|file:///.+)$"
)
# An image reference, optionally pinned by digest (`repo[:tag]@sha256:<64 hex>`).
IMAGE_PATTERN = r"^[^\s@]+(@sha256:[a-f0-9]{64})?$"
# An extended resource name such as amd.com/gpu, or empty for the vendor's own.
RESOURCE_NAME_PATTERN = (
    r"^$|^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)


def _int(description: str, default: int | None = None, minimum: int | None = None,
         maximum: int | None = None) -> dict[str, Any]:  # fmt: skip
    field: dict[str, Any] = {"type": "integer", "description": description}
    if default is not None:
        field["default"] = default
    if minimum is not None:
        field["minimum"] = minimum
    if maximum is not None:
        field["maximum"] = maximum
    return field


def _str(description: str, default: str | None = None, **extra: Any) -> dict[str, Any]:
    field: dict[str, Any] = {"type": "string", "description": description}
    if default is not None:
        field["default"] = default
    field.update(extra)
    return field


def _obj(description: str, properties: dict[str, Any], default: Any = None,
         **extra: Any) -> dict[str, Any]:  # fmt: skip
    field: dict[str, Any] = {"type": "object", "description": description, "properties": properties}
    if default is not None:
        field["default"] = default
    field.update(extra)
    return field


def _free_object(description: str, default: Any = None) -> dict[str, Any]:
    """An object whose contents Kubernetes or the runtime define (kept as written)."""
    field: dict[str, Any] = {
        "type": "object",
        "description": description,
        "x-kubernetes-preserve-unknown-fields": True,
    }
    if default is not None:
        field["default"] = default
    return field


def _string_map(description: str) -> dict[str, Any]:
    return {
        "type": "object",
        "description": description,
        "additionalProperties": {"type": "string"},
        "default": {},
    }


_QUANTITY = {
    "x-kubernetes-int-or-string": True,
    "anyOf": [{"type": "integer"}, {"type": "string"}],
}

_ENV_LIST = {
    "type": "array",
    "description": "Extra environment variables (core/v1 EnvVar); a name that the operator "
    "also sets replaces the operator's value, except POD_IP, which is reserved.",
    "default": [],
    "items": {
        "type": "object",
        "required": ["name"],
        "properties": {
            "name": {"type": "string", "minLength": 1},
            "value": {"type": "string"},
            "valueFrom": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        },
    },
}

_ARGS_LIST = {
    "type": "array",
    "items": {"type": "string"},
    "default": [],
}

_RESOURCES = _obj(
    "Container resources (core/v1 ResourceRequirements). The accelerator resource is set from "
    "tensorParallelSize; do not set it here.",
    {
        "limits": {"type": "object", "additionalProperties": _QUANTITY},
        "requests": {"type": "object", "additionalProperties": _QUANTITY},
    },
    default={},
)

AUTOSCALING_PROVIDERS = ["builtin", "keda", "hpa"]
_TARGET = {"type": "number", "minimum": 0, "exclusiveMinimum": True}

_AUTOSCALING = _obj(
    "Autoscaling of this role on the engine's metrics. provider builtin (default): the operator "
    "scrapes the pods' /metrics itself and sets the Deployment's replicas (nothing else to "
    "install); keda: a KEDA ScaledObject with Prometheus triggers; hpa: an autoscaling/v2 "
    "HorizontalPodAutoscaler on custom metrics (needs the Prometheus adapter). When enabled the "
    "role's Deployment is rendered without `replicas`: the autoscaler is its only writer.",
    {
        "enabled": {"type": "boolean", "default": False},
        "provider": _str(
            "Who scales the role.", default="builtin", enum=list(AUTOSCALING_PROVIDERS)
        ),
        "minReplicas": _int(
            "Lower bound. 0 (builtin or keda, with the router in front: spec.router.enabled, "
            "always so with a prefill role): scale to zero after scaleToZeroAfterSeconds idle, "
            "back up on queued demand.",
            default=1,
            minimum=0,
        ),
        "maxReplicas": _int("Upper bound; required when enabled.", minimum=1),
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
        "scaleUpStabilizationSeconds": _int(
            "builtin: a rise must hold this long before pods are added (the smallest "
            "recommendation of the window wins); a surge (2x the current pods) acts at once.",
            default=0,
            minimum=0,
            maximum=3600,
        ),
        "scaleDownStabilizationSeconds": _int(
            "Pods are removed only when every recommendation of this window agrees (builtin; "
            "keda and hpa get it as the HPA behavior's scale-down window).",
            default=300,
            minimum=0,
            maximum=3600,
        ),
        "maxStep": _int(
            "builtin: most pods added or removed by one decision (a surge may double).",
            default=4,
            minimum=1,
        ),
        "scaleToZeroAfterSeconds": _int(
            "With minReplicas 0: idle time (no running, waiting or queued request) before the "
            "role goes to zero (builtin; keda's cooldownPeriod).",
            default=300,
            minimum=0,
        ),
        "keda": _obj(
            "provider keda: where KEDA's Prometheus triggers query the engine's metrics.",
            {
                "serverAddress": _str(
                    "Prometheus base URL, e.g. http://prometheus.monitoring:9090.",
                    pattern=r"^https?://\S+$",
                ),
            },
        ),
        "behavior": _free_object(
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


def _role(description: str, default: Any = None) -> dict[str, Any]:
    return _obj(
        description,
        {
            "replicas": _int(
                "Pods of this role (ignored while autoscaling is enabled).", default=1, minimum=0
            ),
            "tensorParallelSize": _int(
                "GPUs per pod; each pod requests this many accelerator devices.",
                default=1,
                minimum=1,
                maximum=16,
            ),
            "resources": copy.deepcopy(_RESOURCES),
            "args": dict(
                _ARGS_LIST,
                description="Extra `atom serve` arguments for this role, "
                "placed after spec.engine.args.",
            ),  # fmt: skip
            "env": copy.deepcopy(_ENV_LIST),
            "autoscaling": copy.deepcopy(_AUTOSCALING),
        },
        default=default,
    )


_TOLERATION = {
    "type": "object",
    "properties": {
        "key": {"type": "string"},
        "operator": {"type": "string", "enum": ["Exists", "Equal"]},
        "value": {"type": "string"},
        "effect": {"type": "string", "enum": ["NoSchedule", "PreferNoSchedule", "NoExecute"]},
        "tolerationSeconds": {"type": "integer"},
    },
}

SPEC_SCHEMA: dict[str, Any] = _obj(
    "What to serve and how: model, engine, accelerator, roles, KV events, checkpoints, service.",
    {
        "model": _obj(
            "The model to serve. Omit `uri` to serve the runtime's bundled default model "
            "(SmolLM2-135M-Instruct).",
            {
                "uri": _str(
                    "hf://<org>/<repo>, pvc://<claim>/<path> or file:///<path in the image>.",
                    pattern=MODEL_URI_PATTERN,
                ),
                "name": _str(
                    "Served model name (OpenAI `model`, KV-event topic). Default: the repo id "
                    "for hf://, the last path segment otherwise.",
                    minLength=1,
                ),
                "authSecretRef": _obj(
                    "Secret key holding a Hugging Face token, exposed to the engine as HF_TOKEN.",
                    {
                        "name": _str("Secret name.", minLength=1),
                        "key": _str("Key in the Secret.", default="HF_TOKEN", minLength=1),
                    },
                    required=["name"],
                ),
            },
            default={},
        ),
        "engine": _obj(
            "The runtime container shared by every role.",
            {
                "image": _str(
                    "Runtime image, a tag or a digest (repo@sha256:...). Default: the ATOM "
                    "runtime image for the accelerator vendor.",
                    minLength=1,
                    pattern=IMAGE_PATTERN,
                ),
                "imagePullPolicy": _str(
                    "Image pull policy.",
                    default="IfNotPresent",
                    enum=["Always", "IfNotPresent", "Never"],
                ),
                "imagePullSecrets": {
                    "type": "array",
                    "default": [],
                    "items": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {"name": {"type": "string", "minLength": 1}},
                    },
                },
                "blockSize": _int(
                    "KV-cache block size in tokens.", default=16, minimum=1, maximum=1024
                ),  # fmt: skip
                "maxModelLen": _int(
                    "Maximum context length; omitted => the model's own.", minimum=1
                ),
                "shmSize": {
                    **_QUANTITY,
                    "default": "8Gi",
                    "description": "Size limit of the memory-backed /dev/shm.",
                },
                "cacheSize": {
                    **_QUANTITY,
                    "default": "100Gi",
                    "description": "Size limit of the writable cache emptyDir (Hugging Face "
                    "downloads, Triton kernels); the root filesystem is read-only.",
                },
                "apiKeySecretRef": _obj(
                    "Secret key holding the API key clients must send (atom serve --api-key, "
                    "read from the ATOM_API_KEY variable, never written into the pod spec).",
                    {
                        "name": _str("Secret name.", minLength=1),
                        "key": _str("Key in the Secret.", default="api-key", minLength=1),
                    },
                    required=["name"],
                ),
                "startupTimeoutSeconds": _int(
                    "How long a pod may take to load the model before it is restarted.",
                    default=1800,
                    minimum=60,
                ),
                "args": dict(
                    _ARGS_LIST,
                    description="Extra `atom serve` arguments, placed after "
                    "the operator's flags (so they win).",
                ),  # fmt: skip
                "env": copy.deepcopy(_ENV_LIST),
            },
            default={},
        ),
        "accelerator": _obj(
            "Which GPUs the engine pods ask for and which nodes they may land on.",
            {
                "vendor": _str(
                    "amd => amd.com/gpu, nvidia => nvidia.com/gpu, cpu => no device.",
                    default="amd",
                    enum=["amd", "nvidia", "cpu"],
                ),
                "resourceName": _str(
                    "Device-plugin resource to request instead of the vendor's.",
                    default="",
                    pattern=RESOURCE_NAME_PATTERN,
                ),
                "productLabels": _obj(
                    "Required node affinity: the node label `key` must have one of `values`.",
                    {
                        "key": _str("Node label key.", minLength=1),
                        "values": {
                            "type": "array",
                            "minItems": 1,
                            "items": {"type": "string"},
                        },
                    },
                    required=["key", "values"],
                ),
                "nodeSelector": _string_map("Extra node selector labels."),
                "tolerations": {
                    "type": "array",
                    "description": "Pod tolerations. Omitted => tolerate the vendor's GPU taint "
                    "(amd.com/gpu or nvidia.com/gpu, Exists, NoSchedule); [] => none.",
                    "items": _TOLERATION,
                },
                "supplementalGroups": {
                    "type": "array",
                    "description": "Extra group ids for the engine process. Omitted => [44] "
                    "(video) for amd; add your nodes' render group id if /dev/dri needs it.",
                    "items": {"type": "integer", "minimum": 0},
                },
            },
            default={},
        ),
        "decode": _role(
            "The decode role (every pod serves whole requests when there is no prefill role).",
            default={},
        ),  # fmt: skip
        "prefill": _role(
            "The prefill role. Present => disaggregated mode: a router fronts "
            "the service and KV moves prefill -> decode."
        ),  # fmt: skip
        "kvTransfer": _obj(
            "KV transfer between prefill and decode (--kv-transfer-config). Only valid with a "
            "prefill role; omitted => the runtime's portable connector.",
            {
                "connector": _str(
                    "Connector class name.", default="AtomPortableConnector", minLength=1
                ),  # fmt: skip
                "config": _free_object("kv_connector_extra_config, passed through.", default={}),
            },
        ),
        "kvEvents": _obj(
            "KV-cache events (vLLM wire format) for cache-aware routers.",
            {
                "enabled": {"type": "boolean", "default": True},
                "port": _int("ZMQ PUB port.", default=5557, minimum=1024, maximum=65535),
                "replayPort": _int(
                    "ZMQ ROUTER replay port.", default=5558, minimum=1024, maximum=65535
                ),  # fmt: skip
            },
            default={},
            **{
                "x-kubernetes-validations": [
                    {
                        "rule": "!has(self.port) || !has(self.replayPort) "
                        "|| self.port != self.replayPort",
                        "message": "port and replayPort must differ",
                        "fieldPath": ".replayPort",
                    },
                    {
                        "rule": f"(!has(self.port) || self.port != {ENGINE_HTTP_PORT}) && "
                        f"(!has(self.replayPort) || self.replayPort != {ENGINE_HTTP_PORT})",
                        "message": f"port {ENGINE_HTTP_PORT} is the engine's HTTP port",
                        "fieldPath": ".port",
                    },
                ]
            },
        ),
        "networkPolicy": _obj(
            "A NetworkPolicy over this deployment's pods: the HTTP port (8000) open to clients "
            "(through the Service) and the operator's autoscaler; every other port (KV events, "
            "KV transfer) only from pods of the same AtomDeployment (the router, the other role) "
            "and from the peers in kvEventsFrom.",
            {
                "enabled": {"type": "boolean", "default": True},
                "kvEventsFrom": {
                    "type": "array",
                    "default": [],
                    "description": "Extra networking/v1 NetworkPolicyPeers allowed to the "
                    "KV-event ports (e.g. llm-d's endpoint picker).",
                    "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                },
            },
            default={},
        ),
        "inferencePool": _obj(
            "A Gateway API Inference Extension InferencePool over the serving pods (decode, and "
            "prefill in disaggregated mode), so an inference gateway with llm-d's endpoint "
            "picker can route instead of (or beside) the router.",
            {
                "enabled": {"type": "boolean", "default": False},
                "endpointPicker": _obj(
                    "The endpoint picker (EPP) Service the gateway consults.",
                    {
                        "name": _str("EPP Service name.", minLength=1),
                        "port": _int(
                            "EPP Service port (ext-proc).", default=9002, minimum=1, maximum=65535
                        ),  # fmt: skip
                        "failureMode": _str(
                            "What the gateway does when the EPP does not answer.",
                            default="FailClose",
                            enum=["FailOpen", "FailClose"],
                        ),
                    },
                ),
            },
            default={},
            **{
                "x-kubernetes-validations": [
                    {
                        "rule": "!has(self.enabled) || !self.enabled "
                        "|| (has(self.endpointPicker) && has(self.endpointPicker.name))",
                        "message": "an enabled inferencePool needs endpointPicker.name",
                        "fieldPath": ".endpointPicker",
                    }
                ]
            },
        ),
        "stateCheckpoint": _obj(
            "Per-request state checkpoints for hybrid (recurrent-state) models.",
            {
                "intervalTokens": _int(
                    "N > 0: a checkpoint every N tokens (a multiple of engine.blockSize); 0: off; "
                    "-1: no ladder, prompt-end anchors and demand checkpoints only.",
                    default=-1,
                    minimum=-1,
                ),
                "demand": {"type": "boolean", "default": True},
                "memoryFraction": {
                    "type": "number",
                    "description": "The share of the KV block pool checkpoints may borrow at "
                    "most (least recently used ones are evicted beyond it; live KV reclaims them "
                    "whenever it needs the blocks).",
                    "default": 0.1,
                    "minimum": 0,
                    "exclusiveMinimum": True,
                    "maximum": 1,
                },
            },
            default={},
        ),
        "service": _obj(
            "The user-facing Service (the router when there is one, else the decode pods).",
            {
                "type": _str(
                    "Service type.",
                    default="ClusterIP",
                    enum=["ClusterIP", "NodePort", "LoadBalancer"],
                ),
                "port": _int("Service port.", default=8000, minimum=1, maximum=65535),
                "annotations": _string_map("Service annotations."),
            },
            default={},
        ),
        "router": _obj(
            "The KV-cache-aware router (`atom router`) in front of the engine pods: it sends each "
            "request to the decode pod that caches the longest prefix of its prompt (from the "
            "pods' KV events), weighed against load, and holds requests while decode is at zero. "
            "Always on in disaggregated mode; opt-in for an aggregated deployment.",
            {
                "enabled": {
                    "type": "boolean",
                    "description": "Run the router and point the user-facing Service at it. "
                    "Omitted => true with a prefill role (which cannot run without it), false "
                    "otherwise (the Service balances over the decode pods).",
                },
                "image": _str(
                    "Router image (tag or digest). Default: spec.engine.image.",
                    minLength=1,
                    pattern=IMAGE_PATTERN,
                ),
                "replicas": _int("Router pods.", default=1, minimum=1),
                "resources": copy.deepcopy(_RESOURCES),
            },
            default={},
        ),
    },
    **{
        "x-kubernetes-validations": [
            {
                "rule": "!has(self.stateCheckpoint) || !has(self.stateCheckpoint.intervalTokens) "
                "|| self.stateCheckpoint.intervalTokens <= 0 "
                "|| self.stateCheckpoint.intervalTokens % "
                "(has(self.engine) && has(self.engine.blockSize) ? self.engine.blockSize : 16) == 0",
                "message": "stateCheckpoint.intervalTokens must be -1, 0 or a multiple of "
                "engine.blockSize",
                "fieldPath": ".stateCheckpoint.intervalTokens",
            },
            {
                "rule": "!has(self.accelerator) || !has(self.accelerator.vendor) "
                "|| self.accelerator.vendor != 'cpu' || !has(self.decode) "
                "|| !has(self.decode.tensorParallelSize) || self.decode.tensorParallelSize == 1",
                "message": "the cpu vendor has no GPUs: decode.tensorParallelSize must be 1",
                "fieldPath": ".decode.tensorParallelSize",
            },
            {
                "rule": "!has(self.accelerator) || !has(self.accelerator.vendor) "
                "|| self.accelerator.vendor != 'cpu' || !has(self.prefill) "
                "|| !has(self.prefill.tensorParallelSize) || self.prefill.tensorParallelSize == 1",
                "message": "the cpu vendor has no GPUs: prefill.tensorParallelSize must be 1",
                "fieldPath": ".prefill.tensorParallelSize",
            },
            {
                "rule": "!has(self.accelerator) || !has(self.accelerator.vendor) "
                "|| self.accelerator.vendor != 'cpu' || !has(self.accelerator.resourceName) "
                "|| self.accelerator.resourceName == ''",
                "message": "the cpu vendor requests no device: resourceName must be empty",
                "fieldPath": ".accelerator.resourceName",
            },
            # Disaggregated mode cannot run without the router (it sends prompts to prefill).
            {
                "rule": "!has(self.prefill) || !has(self.router) || !has(self.router.enabled) "
                "|| self.router.enabled",
                "message": "router.enabled cannot be false with a prefill role: the router is "
                "what sends prompts to the prefill pods and their KV to the decode pods",
                "fieldPath": ".router.enabled",
            },
            # Only the router holds requests while decode has no pod. router.enabled omitted
            # means true with a prefill role, false without (atom_operator.spec.has_router).
            {
                "rule": "!has(self.decode) || !has(self.decode.autoscaling) "
                "|| !has(self.decode.autoscaling.minReplicas) "
                "|| self.decode.autoscaling.minReplicas > 0 || has(self.prefill) "
                "|| (has(self.router) && has(self.router.enabled) && self.router.enabled)",
                "message": "decode scales to zero only behind the router, which holds requests "
                "meanwhile: set router.enabled (or add a prefill role) or set minReplicas >= 1",
                "fieldPath": ".decode.autoscaling.minReplicas",
            },
            # The portable KV connector moves one engine's whole KV cache; a tensor-parallel
            # engine holds a shard per rank, so the engine refuses --kv-transfer-config with
            # TP > 1 (runtime/atom_runtime/kv_transfer). Both roles carry that flag.
            {
                "rule": "!has(self.prefill) || !has(self.prefill.tensorParallelSize) "
                "|| self.prefill.tensorParallelSize == 1",
                "message": "prefill.tensorParallelSize must be 1: the KV-transfer connector of "
                "disaggregated mode moves one engine's whole KV cache and refuses tensor "
                "parallelism",
                "fieldPath": ".prefill.tensorParallelSize",
            },
            {
                "rule": "!has(self.prefill) || !has(self.decode) "
                "|| !has(self.decode.tensorParallelSize) || self.decode.tensorParallelSize == 1",
                "message": "decode.tensorParallelSize must be 1 with a prefill role: the "
                "KV-transfer connector of disaggregated mode moves one engine's whole KV cache "
                "and refuses tensor parallelism",
                "fieldPath": ".decode.tensorParallelSize",
            },
            {
                "rule": "!has(self.kvTransfer) || has(self.prefill)",
                "message": "kvTransfer needs a prefill role (disaggregated mode)",
                "fieldPath": ".kvTransfer",
            },
        ]
    },
)

_ROLE_STATUS = {
    "type": "object",
    "x-kubernetes-preserve-unknown-fields": True,
    "properties": {
        "replicas": {"type": "integer", "description": "Pods that exist (Deployment status)."},
        "readyReplicas": {"type": "integer"},
        "updatedReplicas": {"type": "integer"},
        "desiredReplicas": {"type": "integer", "description": "The Deployment's spec.replicas."},
        "selector": {"type": "string", "description": "Label selector of the role's pods."},
        "ready": {"type": "string", "description": "`ready/desired`, for kubectl get."},
    },
}

STATUS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "x-kubernetes-preserve-unknown-fields": True,
    "properties": {
        "observedGeneration": {"type": "integer"},
        "phase": {"type": "string"},
        "endpoint": {"type": "string", "description": "OpenAI base URL inside the cluster."},
        "model": {"type": "string", "description": "The served model name."},
        "roles": {
            "type": "object",
            "properties": {
                "decode": _ROLE_STATUS,
                "prefill": _ROLE_STATUS,
                "router": _ROLE_STATUS,
            },
        },
        "autoscaling": {
            "type": "object",
            "description": "provider builtin: the last decision per role (desired, observed "
            "metrics, reason), written by the operator's autoscaler.",
            "x-kubernetes-preserve-unknown-fields": True,
        },
        "conditions": {
            "type": "array",
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["type"],
            "items": {
                "type": "object",
                "required": ["type", "status"],
                "properties": {
                    "type": {"type": "string"},
                    "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
                    "reason": {"type": "string"},
                    "message": {"type": "string"},
                    "lastTransitionTime": {"type": "string", "format": "date-time"},
                    "observedGeneration": {"type": "integer"},
                },
            },
        },
    },
}

PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Model", "type": "string", "jsonPath": ".status.model"},
    {"name": "Vendor", "type": "string", "jsonPath": ".spec.accelerator.vendor"},
    {
        "name": "Decode",
        "type": "string",
        "jsonPath": ".status.roles.decode.ready",
        "description": "ready/desired decode pods",
    },  # fmt: skip
    {
        "name": "Prefill",
        "type": "string",
        "jsonPath": ".status.roles.prefill.ready",
        "description": "ready/desired prefill pods",
    },  # fmt: skip
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def crd() -> dict[str, Any]:
    """The AtomDeployment CustomResourceDefinition (apiextensions.k8s.io/v1)."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": CRD_NAME,
            "labels": {"app.kubernetes.io/name": "atom-operator"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": list(SHORT_NAMES),
                "categories": ["all", "atom"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "An LLM served by ATOM runtime pods: decode and "
                            "optional prefill roles, a Service, autoscaling.",
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": copy.deepcopy(SPEC_SCHEMA),
                                "status": copy.deepcopy(STATUS_SCHEMA),
                            },
                            "required": ["spec"],
                        }
                    },
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.decode.replicas",
                            "statusReplicasPath": ".status.roles.decode.replicas",
                            "labelSelectorPath": ".status.roles.decode.selector",
                        },
                    },
                    "additionalPrinterColumns": copy.deepcopy(PRINTER_COLUMNS),
                }
            ],
        },
    }


HEADER = (
    "# Generated by `python -m atom_operator.schema` from operator/atom_operator/schema.py.\n"
    "# Do not edit by hand: change schema.py and regenerate (a test compares the two).\n"
)


def crd_yaml() -> str:
    """The CRD as the YAML text committed under crds/ and charts/atom-operator/crds/."""
    return HEADER + yaml.safe_dump(crd(), sort_keys=False, width=100)


if __name__ == "__main__":
    sys.stdout.write(crd_yaml())

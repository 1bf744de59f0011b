"""spec.engine (the runtime container every role shares) and spec.accelerator (which GPUs and
nodes)."""

from __future__ import annotations

import copy

from atom_operator.schema.api import IMAGE_PATTERN, RESOURCE_NAME_PATTERN
from atom_operator.schema.engine_features import ENGINE_FEATURES
from atom_operator.schema.fields import (
    ARGS_LIST,
    ENV_LIST,
    QUANTITY,
    TOLERATION,
    int_field,
    object_field,
    secret_key_ref,
    str_field,
    string_map,
)

ENGINE = object_field(
    "The runtime container shared by every role.",
    {
        "image": str_field(
            "Runtime image, a tag or a digest (repo@sha256:...). Default: the ATOM "
            "runtime image for the accelerator vendor.",
            minLength=1,
            pattern=IMAGE_PATTERN,
        ),
        "imagePullPolicy": str_field(
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
        "blockSize": int_field(
            "KV-cache block size in tokens.", default=16, minimum=1, maximum=1024
        ),  # fmt: skip
        "maxModelLen": int_field("Maximum context length; omitted => the model's own.", minimum=1),
        "shmSize": {
            **QUANTITY,
            "default": "8Gi",
            "description": "Size limit of the memory-backed /dev/shm.",
        },
        "cacheSize": {
            **QUANTITY,
            "default": "100Gi",
            "description": "Size limit of the writable cache emptyDir (Hugging Face "
            "downloads, Triton kernels); the root filesystem is read-only.",
        },
        "apiKeySecretRef": secret_key_ref(
            "Secret key holding the API key clients must send (atom serve --api-key, "
            "read from the ATOM_API_KEY variable, never written into the pod spec).",
            "api-key",
        ),
        "startupTimeoutSeconds": int_field(
            "How long a pod may take to load the model before it is restarted.",
            default=1800,
            minimum=60,
        ),
        "args": dict(
            ARGS_LIST,
            description="Extra `atom serve` arguments, placed after "
            "the operator's flags (so they win).",
        ),  # fmt: skip
        "env": copy.deepcopy(ENV_LIST),
        **ENGINE_FEATURES,
    },
    default={},
)

ACCELERATOR = object_field(
    "Which GPUs the engine pods ask for and which nodes they may land on.",
    {
        "vendor": str_field(
            "amd => amd.com/gpu, nvidia => nvidia.com/gpu, cpu => no device.",
            default="amd",
            enum=["amd", "nvidia", "cpu"],
        ),
        "resourceName": str_field(
            "Device-plugin resource to request instead of the vendor's.",
            default="",
            pattern=RESOURCE_NAME_PATTERN,
        ),
        "productLabels": object_field(
            "Required node affinity: the node label `key` must have one of `values`.",
            {
                "key": str_field("Node label key.", minLength=1),
                "values": {
                    "type": "array",
                    "minItems": 1,
                    "items": {"type": "string"},
                },
            },
            required=["key", "values"],
        ),
        "nodeSelector": string_map("Extra node selector labels."),
        "tolerations": {
            "type": "array",
            "description": "Pod tolerations. Omitted => tolerate the vendor's GPU taint "
            "(amd.com/gpu or nvidia.com/gpu, Exists, NoSchedule); [] => none.",
            "items": TOLERATION,
        },
        "supplementalGroups": {
            "type": "array",
            "description": "Extra group ids for the engine process. Omitted => [44] "
            "(video) for amd; add your nodes' render group id if /dev/dri needs it.",
            "items": {"type": "integer", "minimum": 0},
        },
    },
    default={},
)

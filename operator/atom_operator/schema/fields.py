"""Builders for the structural-schema nodes the AtomDeployment schema is made of, and the
nodes several sections share (env lists, args lists, resources, tolerations)."""

from __future__ import annotations

from typing import Any

from atom_operator.schema.api import OBJECT_NAME_PATTERN


def int_field(description: str, default: int | None = None, minimum: int | None = None,
         maximum: int | None = None) -> dict[str, Any]:  # fmt: skip
    field: dict[str, Any] = {"type": "integer", "description": description}
    if default is not None:
        field["default"] = default
    if minimum is not None:
        field["minimum"] = minimum
    if maximum is not None:
        field["maximum"] = maximum
    return field


def str_field(description: str, default: str | None = None, **extra: Any) -> dict[str, Any]:
    field: dict[str, Any] = {"type": "string", "description": description}
    if default is not None:
        field["default"] = default
    field.update(extra)
    return field


def object_field(description: str, properties: dict[str, Any], default: Any = None,
         **extra: Any) -> dict[str, Any]:  # fmt: skip
    field: dict[str, Any] = {"type": "object", "description": description, "properties": properties}
    if default is not None:
        field["default"] = default
    field.update(extra)
    return field


def free_object(description: str, default: Any = None) -> dict[str, Any]:
    """An object whose contents Kubernetes or the runtime define (kept as written)."""
    field: dict[str, Any] = {
        "type": "object",
        "description": description,
        "x-kubernetes-preserve-unknown-fields": True,
    }
    if default is not None:
        field["default"] = default
    return field


def secret_key_ref(description: str, default_key: str) -> dict[str, Any]:
    """`{name, key}` naming one key of a Secret in the AtomDeployment's namespace."""
    return object_field(
        description,
        {
            "name": str_field("Secret name.", minLength=1, pattern=OBJECT_NAME_PATTERN),
            "key": str_field("Key in the Secret.", default=default_key, minLength=1),
        },
        required=["name"],
    )


def string_map(description: str) -> dict[str, Any]:
    return {
        "type": "object",
        "description": description,
        "additionalProperties": {"type": "string"},
        "default": {},
    }


QUANTITY = {
    "x-kubernetes-int-or-string": True,
    "anyOf": [{"type": "integer"}, {"type": "string"}],
}

ENV_LIST = {
    "type": "array",
    "description": "Extra environment variables (core/v1 EnvVar); a name that the operator "
    "also sets replaces the operator's value, except the reserved ones (POD_IP, ATOM_API_KEY, "
    "ATOM_TRANSFER_KEY_FILE). A `value` is passed literally (`$` is escaped: no $(VAR) "
    "expansion). valueFrom: fieldRef and resourceFieldRef; secretKeyRef and configMapKeyRef "
    "only for the names the operator's configuration allows.",
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

ARGS_LIST = {
    "type": "array",
    "items": {"type": "string"},
    "default": [],
}

RESOURCES = object_field(
    "Container resources (core/v1 ResourceRequirements). The accelerator resource is set from "
    "tensorParallelSize; do not set it here.",
    {
        "limits": {"type": "object", "additionalProperties": QUANTITY},
        "requests": {"type": "object", "additionalProperties": QUANTITY},
    },
    default={},
)

TOLERATION = {
    "type": "object",
    "properties": {
        "key": {"type": "string"},
        "operator": {"type": "string", "enum": ["Exists", "Equal"]},
        "value": {"type": "string"},
        "effect": {"type": "string", "enum": ["NoSchedule", "PreferNoSchedule", "NoExecute"]},
        "tolerationSeconds": {"type": "integer"},
    },
}

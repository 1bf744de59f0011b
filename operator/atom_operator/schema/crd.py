"""The CustomResourceDefinition: the spec schema, the status schema, printer columns, the scale
subresource; and the YAML text committed under crds/."""

from __future__ import annotations

import copy
from typing import Any

import yaml

from atom_operator.schema.api import (
    CRD_NAME,
    GROUP,
    KIND,
    PLURAL,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
)
from atom_operator.schema.atomdeployment import SPEC_SCHEMA

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
    "# Generated by `python -m atom_operator.schema` from operator/atom_operator/schema/.\n"
    "# Do not edit by hand: change the schema package and regenerate (a test compares the two).\n"
)


def crd_yaml() -> str:
    """The CRD as the YAML text committed under crds/ and charts/atom-operator/crds/."""
    return HEADER + yaml.safe_dump(crd(), sort_keys=False, width=100)

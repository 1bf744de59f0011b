"""How requests reach the engines: the user-facing Service, the router, the NetworkPolicy and an
InferencePool for an inference gateway."""

from __future__ import annotations

import copy

from atom_operator.schema.api import IMAGE_PATTERN
from atom_operator.schema.fields import (
    RESOURCES,
    int_field,
    object_field,
    secret_key_ref,
    str_field,
    string_map,
)

SERVICE = object_field(
    "The user-facing Service (the router when there is one, else the decode pods).",
    {
        "type": str_field(
            "Service type.",
            default="ClusterIP",
            enum=["ClusterIP", "NodePort", "LoadBalancer"],
        ),
        "port": int_field("Service port.", default=8000, minimum=1, maximum=65535),
        "annotations": string_map("Service annotations."),
    },
    default={},
)

ROUTER = object_field(
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
        "image": str_field(
            "Router image (tag or digest). Default: spec.engine.image.",
            minLength=1,
            pattern=IMAGE_PATTERN,
        ),
        "replicas": int_field("Router pods.", default=1, minimum=1),
        "resources": copy.deepcopy(RESOURCES),
        "apiKeySecret": secret_key_ref(
            "Secret key holding the router's own API key (`atom router --api-key`, read from "
            "the ATOM_ROUTER_API_KEY variable, never written into the pod spec); /health stays "
            "open.",
            "api-key",
        ),
    },
    default={},
)

NETWORK_POLICY = object_field(
    "NetworkPolicies over this deployment's pods. Without a router: the engines' HTTP port "
    "(8000) open to clients. With a router: the router's HTTP port open to clients; the "
    "engines' HTTP port only from this deployment's pods, the operator (its /metrics scrape) "
    "and httpFrom; the KV-event ports only from the router and kvEventsFrom; the KV-transfer "
    "ports only from this deployment's engine pods.",
    {
        "enabled": {"type": "boolean", "default": True},
        "httpFrom": {
            "type": "array",
            "default": [],
            "description": "With a router: extra networking/v1 NetworkPolicyPeers allowed to "
            "the engines' HTTP port (an inference gateway with inferencePool, Prometheus).",
            "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        },
        "kvEventsFrom": {
            "type": "array",
            "default": [],
            "description": "Extra networking/v1 NetworkPolicyPeers allowed to the "
            "KV-event ports (e.g. llm-d's endpoint picker).",
            "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        },
    },
    default={},
)

INFERENCE_POOL = object_field(
    "A Gateway API Inference Extension InferencePool over the serving pods (decode, and "
    "prefill in disaggregated mode), so an inference gateway with llm-d's endpoint "
    "picker can route instead of (or beside) the router.",
    {
        "enabled": {"type": "boolean", "default": False},
        "endpointPicker": object_field(
            "The endpoint picker (EPP) Service the gateway consults.",
            {
                "name": str_field("EPP Service name.", minLength=1),
                "port": int_field(
                    "EPP Service port (ext-proc).", default=9002, minimum=1, maximum=65535
                ),  # fmt: skip
                "failureMode": str_field(
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
)

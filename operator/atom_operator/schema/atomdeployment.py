"""The whole AtomDeployment spec: its sections, and the CEL rules that relate one section to another."""

from __future__ import annotations

from typing import Any

from atom_operator.schema.autoscaling import role_section
from atom_operator.schema.engine import ACCELERATOR, ENGINE
from atom_operator.schema.fields import object_field
from atom_operator.schema.kv import KV_EVENTS, KV_TRANSFER, STATE_CHECKPOINT
from atom_operator.schema.model import MODEL
from atom_operator.schema.traffic import INFERENCE_POOL, NETWORK_POLICY, ROUTER, SERVICE

CROSS_FIELD_RULES: list[dict[str, Any]] = [
    {
        "rule": "!has(self.stateCheckpoint) || !has(self.stateCheckpoint.intervalTokens) "
        "|| self.stateCheckpoint.intervalTokens <= 0 "
        "|| self.stateCheckpoint.intervalTokens % "
        "(has(self.engine) && has(self.engine.blockSize) ? self.engine.blockSize : 16) == 0",
        "message": "stateCheckpoint.intervalTokens must be -1, 0 or a multiple of engine.blockSize",
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
    {
        "rule": "!has(self.kvTransfer) || has(self.prefill)",
        "message": "kvTransfer needs a prefill role (disaggregated mode)",
        "fieldPath": ".kvTransfer",
    },
]

SPEC_SCHEMA: dict[str, Any] = object_field(
    "What to serve and how: model, engine, accelerator, roles, KV events, checkpoints, service.",
    {
        "model": MODEL,
        "engine": ENGINE,
        "accelerator": ACCELERATOR,
        "decode": role_section(
            "The decode role (every pod serves whole requests when there is no prefill role).",
            default={},
        ),
        "prefill": role_section(
            "The prefill role. Present => disaggregated mode: a router fronts "
            "the service and KV moves prefill -> decode."
        ),
        "kvTransfer": KV_TRANSFER,
        "kvEvents": KV_EVENTS,
        "networkPolicy": NETWORK_POLICY,
        "inferencePool": INFERENCE_POOL,
        "stateCheckpoint": STATE_CHECKPOINT,
        "service": SERVICE,
        "router": ROUTER,
    },
    **{"x-kubernetes-validations": CROSS_FIELD_RULES},
)

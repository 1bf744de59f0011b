"""AtomDeployment spec validation: the same rules as the CRD, in Python.

`validate_spec` checks the structural schema (types, bounds, enums, patterns, unknown fields),
then the CEL rules of the CRD mirrored below, then a few checks only Python can make. A spec that
slipped past an older CRD, or one fed to `atom render` without any API server, is still caught.
"""

from __future__ import annotations

import re
from typing import Any

from atom_operator.model_source import SOURCE_KINDS, parse_model_uri
from atom_operator.operator_config import DEFAULT_CONFIG, OperatorConfig
from atom_operator.schema import ENGINE_HTTP_PORT, SPEC_SCHEMA
from atom_operator.schema.api import MODEL_NAME_MAX, MODEL_NAME_PATTERN
from atom_operator.spec import (
    RESERVED_ENV,
    ROLES,
    SpecError,
    apply_defaults,
    has_router,
    vendor_resource,
)

# --- structural validation --------------------------------------------------------------------


def _type_name(value: Any) -> str:
    return type(value).__name__


def _check_schema(value: Any, schema: dict[str, Any], field: str) -> None:
    """Validate `value` against the structural-schema subset SPEC_SCHEMA uses."""
    if schema.get("x-kubernetes-int-or-string"):
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise SpecError(field, f"must be an integer or a string, got {_type_name(value)}")
        return
    kind = schema.get("type")
    if kind == "object":
        if not isinstance(value, dict):
            raise SpecError(field, f"must be an object, got {_type_name(value)}")
        for name in schema.get("required", []):
            if name not in value:
                raise SpecError(f"{field}.{name}", "is required")
        properties = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for name, sub_value in value.items():
            if name in properties:
                _check_schema(sub_value, properties[name], f"{field}.{name}")
            elif isinstance(extra, dict):
                _check_schema(sub_value, extra, f"{field}.{name}")
            elif not schema.get("x-kubernetes-preserve-unknown-fields"):
                known = ", ".join(sorted(properties)) or "none"
                raise SpecError(f"{field}.{name}", f"unknown field (known fields: {known})")
        return
    if kind == "array":
        if not isinstance(value, list):
            raise SpecError(field, f"must be a list, got {_type_name(value)}")
        if len(value) < schema.get("minItems", 0):
            raise SpecError(field, f"must have at least {schema['minItems']} item(s)")
        for index, item in enumerate(value):
            _check_schema(item, schema.get("items", {}), f"{field}[{index}]")
        return
    if kind == "string":
        if not isinstance(value, str):
            raise SpecError(field, f"must be a string, got {_type_name(value)}")
        if len(value) < schema.get("minLength", 0):
            raise SpecError(field, "must not be empty")
        if len(value) > schema.get("maxLength", len(value)):
            raise SpecError(field, f"must be at most {schema['maxLength']} characters")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            raise SpecError(field, f"{value!r} does not match {schema['pattern']}")
    elif kind == "boolean":
        if not isinstance(value, bool):
            raise SpecError(field, f"must be true or false, got {_type_name(value)}")
    elif kind in ("integer", "number"):
        allowed = (int,) if kind == "integer" else (int, float)
        if isinstance(value, bool) or not isinstance(value, allowed):
            raise SpecError(field, f"must be {'an integer' if kind == 'integer' else 'a number'}, "
                            f"got {_type_name(value)}")  # fmt: skip
        if "minimum" in schema:
            low = schema["minimum"]
            if schema.get("exclusiveMinimum") and value <= low:
                raise SpecError(field, f"must be > {low}, got {value}")
            if value < low:
                raise SpecError(field, f"must be >= {low}, got {value}")
        if "maximum" in schema and value > schema["maximum"]:
            raise SpecError(field, f"must be <= {schema['maximum']}, got {value}")
    if "enum" in schema and value not in schema["enum"]:
        choices = ", ".join(str(choice) for choice in schema["enum"])
        raise SpecError(field, f"must be one of {choices}, got {value!r}")


# --- cross-field rules (the CRD's x-kubernetes-validations, plus Python-only checks) -----------


TARGETS = ("targetRequestsWaiting", "targetRequestsRunning", "targetKVCacheUsage",
           "targetTTFTSeconds")  # fmt: skip


def _check_autoscaling(autoscaling: dict[str, Any], field: str) -> None:
    low, high = autoscaling.get("minReplicas"), autoscaling.get("maxReplicas")
    provider = autoscaling.get("provider", "builtin")
    if low is not None and high is not None and low > high:
        raise SpecError(f"{field}.minReplicas", f"must be <= maxReplicas ({high}), got {low}")
    if autoscaling.get("enabled"):
        if high is None:
            raise SpecError(f"{field}.maxReplicas", "is required when autoscaling is enabled")
        if not any(name in autoscaling for name in TARGETS):
            raise SpecError(
                f"{field}.enabled",
                f"set at least one of {', '.join(TARGETS)} when autoscaling is enabled",
            )
        if provider == "keda" and "serverAddress" not in (autoscaling.get("keda") or {}):
            raise SpecError(
                f"{field}.keda", "provider keda needs keda.serverAddress (the Prometheus URL)"
            )
    if provider == "hpa" and low is not None and low < 1:
        raise SpecError(
            f"{field}.minReplicas", f"provider hpa cannot scale to zero: must be >= 1, got {low}"
        )
    if provider == "hpa" and "targetTTFTSeconds" in autoscaling:
        raise SpecError(
            f"{field}.targetTTFTSeconds",
            "provider hpa has no TTFT quantile metric: use builtin or keda",
        )


def _check_model_source(model: dict[str, Any]) -> None:
    """spec.model's CEL rules (schema/model.py): uri or source; one kind of source; the
    Hugging Face cache either an existing claim or a size."""
    if "uri" in model and "source" in model:
        raise SpecError("spec.model.source", "give model.uri or model.source, not both")
    source = model.get("source")
    if source is None:
        return
    kinds = [kind for kind in SOURCE_KINDS if kind in source]
    if len(kinds) != 1:
        raise SpecError(
            "spec.model.source.pvc",
            f"give exactly one of pvc, huggingface, image (got {', '.join(kinds) or 'none'})",
        )
    hub = source.get("huggingface")
    if hub is not None:
        field = "spec.model.source.huggingface"
        if ("cachePVC" in hub) == ("size" in hub):
            raise SpecError(
                f"{field}.size",
                "give exactly one of cachePVC (an existing claim) and size (the operator "
                "creates one)",
            )
        if "storageClassName" in hub and "size" not in hub:
            raise SpecError(
                f"{field}.storageClassName", "is for the claim the operator creates (size)"
            )


def _check_speculative(spec: dict[str, Any]) -> None:
    """spec.engine.speculative's CEL rules (schema/engine_features.py)."""
    speculative = spec["engine"].get("speculative")
    if speculative is None:
        return
    field, method = "spec.engine.speculative", speculative["method"]
    if method == "draft_model" and "model" not in speculative:
        raise SpecError(f"{field}.model", "method draft_model needs model (the draft model)")
    if method != "draft_model" and "model" in speculative:
        raise SpecError(
            f"{field}.model", f"is for method draft_model ({method} uses the served model)"
        )
    lookup = [name for name in ("promptLookupMin", "promptLookupMax") if name in speculative]
    if method != "ngram" and lookup:
        raise SpecError(f"{field}.promptLookupMin", "promptLookupMin/Max are for method ngram")
    low, high = speculative.get("promptLookupMin"), speculative.get("promptLookupMax")
    if low is not None and high is not None and low > high:
        raise SpecError(f"{field}.promptLookupMax", f"must be >= promptLookupMin ({low})")
    draft_tp = speculative.get("draftTensorParallelSize")
    if draft_tp is not None and method == "ngram":
        raise SpecError(
            f"{field}.draftTensorParallelSize", "is for a drafting model (draft_model, mtp)"
        )
    if draft_tp is not None and draft_tp != 1:
        # The runtime runs a draft model or an MTP head whole on rank 0's GPU
        # (spec_decode/config.py).
        raise SpecError(f"{field}.draftTensorParallelSize", f"must be 1, got {draft_tp}")


def _check_cross_fields(spec: dict[str, Any]) -> None:
    """Mirror of the CRD's CEL rules, on a defaulted spec, with the values in the message."""
    block = spec["engine"]["blockSize"]
    interval = spec["stateCheckpoint"]["intervalTokens"]
    if interval > 0 and interval % block:
        raise SpecError(
            "spec.stateCheckpoint.intervalTokens",
            f"must be a multiple of spec.engine.blockSize ({block}), got {interval}",
        )
    accelerator = spec["accelerator"]
    if accelerator["vendor"] == "cpu":
        for role in ROLES:
            if role in spec and spec[role]["tensorParallelSize"] != 1:
                raise SpecError(
                    f"spec.{role}.tensorParallelSize",
                    f"must be 1 with accelerator.vendor cpu (no GPUs), "
                    f"got {spec[role]['tensorParallelSize']}",
                )
        if accelerator["resourceName"]:
            raise SpecError(
                "spec.accelerator.resourceName",
                f"must be empty with accelerator.vendor cpu, got {accelerator['resourceName']!r}",
            )
    for role in ROLES:
        if role in spec:
            _check_autoscaling(spec[role]["autoscaling"], f"spec.{role}.autoscaling")
    if "prefill" in spec and not spec["router"]["enabled"]:
        raise SpecError(
            "spec.router.enabled",
            "cannot be false with a prefill role: the router is what sends prompts to the "
            "prefill pods and their KV to the decode pods",
        )
    if spec["decode"]["autoscaling"]["minReplicas"] == 0 and not has_router(spec):
        raise SpecError(
            "spec.decode.autoscaling.minReplicas",
            "decode scales to zero only behind the router, which holds requests meanwhile: "
            "set router.enabled (or add a prefill role) or set minReplicas >= 1",
        )
    events = spec["kvEvents"]
    if events["port"] == events["replayPort"]:
        raise SpecError("spec.kvEvents.replayPort", f"must differ from port ({events['port']})")
    for name in ("port", "replayPort"):
        if events[name] == ENGINE_HTTP_PORT:
            raise SpecError(
                f"spec.kvEvents.{name}", f"{ENGINE_HTTP_PORT} is the engine's HTTP port"
            )
    pool = spec["inferencePool"]
    if pool["enabled"] and "name" not in (pool.get("endpointPicker") or {}):
        raise SpecError(
            "spec.inferencePool.endpointPicker",
            "an enabled inferencePool needs endpointPicker.name",
        )
    _check_speculative(spec)
    _check_model_source(spec["model"])
    if "kvTransfer" in spec and "prefill" not in spec:
        raise SpecError("spec.kvTransfer", "needs a prefill role (disaggregated mode)")


def _check_python_only(spec: dict[str, Any], config: OperatorConfig) -> None:
    """Rules CEL cannot state well: quantities compared with counts, reserved env names, and
    what the operator's configuration allows (env references)."""
    resource = vendor_resource(spec["accelerator"])
    for role in ROLES:
        if role not in spec:
            continue
        for section in ("limits", "requests"):
            if resource and resource in spec[role]["resources"].get(section, {}):
                raise SpecError(
                    f"spec.{role}.resources.{section}[{resource}]",
                    "is set from tensorParallelSize; remove it",
                )
    name = spec["model"].get("name", "")
    if not re.match(MODEL_NAME_PATTERN, name) or len(name) > MODEL_NAME_MAX:
        raise SpecError(
            "spec.model.name",
            f"{name!r} (derived from the model's location) is not a valid served model name: "
            f"set spec.model.name (pattern {MODEL_NAME_PATTERN})",
        )
    env_lists = [("spec.engine.env", spec["engine"]["env"])]
    env_lists += [(f"spec.{role}.env", spec[role]["env"]) for role in ROLES if role in spec]
    for field, env in env_lists:
        for index, var in enumerate(env):
            if var["name"] in RESERVED_ENV:
                raise SpecError(
                    f"{field}[{index}].name",
                    f"{var['name']} is reserved ({RESERVED_ENV[var['name']]})",
                )
            _check_env_source(var.get("valueFrom"), f"{field}[{index}].valueFrom", config)


# valueFrom sources an AtomDeployment's env may use, and for the two that read an object, the
# OperatorConfig field that lists the names allowed.
_ENV_SOURCES = {
    "fieldRef": None,
    "resourceFieldRef": None,
    "secretKeyRef": ("Secret", "env_secrets", "--allow-env-secret"),
    "configMapKeyRef": ("ConfigMap", "env_config_maps", "--allow-env-configmap"),
}


def _check_env_source(value_from: Any, field: str, config: OperatorConfig) -> None:
    """An env variable's valueFrom reads only what the operator's configuration allows: the
    AtomDeployment's author controls the pod's arguments, so a reference to any Secret of the
    namespace would hand them its value."""
    if value_from is None:
        return
    for source, ref in value_from.items():
        if source not in _ENV_SOURCES:
            known = ", ".join(_ENV_SOURCES)
            raise SpecError(f"{field}.{source}", f"unsupported source (use one of {known})")
        allowed_by = _ENV_SOURCES[source]
        if allowed_by is None:
            continue
        kind, attribute, flag = allowed_by
        name = ref.get("name") if isinstance(ref, dict) else None
        allowed = getattr(config, attribute)
        if name not in allowed:
            listed = ", ".join(sorted(allowed)) or "none"
            raise SpecError(
                f"{field}.{source}.name",
                f"{kind} {name!r} is not one the operator lets an AtomDeployment read "
                f"(allowed: {listed}); the operator's administrator allows one with "
                f"`atom operator run {flag} NAME` (chart value envReferences)",
            )


def spec_warnings(spec: dict[str, Any]) -> list[tuple[str, str]]:
    """(reason, message) for each choice of a valid, defaulted spec that is allowed but most
    likely not meant: the operator posts them as Warning events and applies the spec anyway."""
    warnings = []
    if has_router(spec) and not spec["kvEvents"]["enabled"]:
        warnings.append(
            (
                "RouterWithoutKVEvents",
                "spec.kvEvents.enabled is false: the router subscribes to no KV events, so it "
                "ranks decode pods on load alone and cannot send a prompt to the pod that "
                "caches its prefix; enable kvEvents for cache-aware routing",
            )
        )
    policy = spec["networkPolicy"]
    if (has_router(spec) and spec["inferencePool"]["enabled"] and policy["enabled"]
            and not policy["httpFrom"]):  # fmt: skip
        warnings.append(
            (
                "GatewayBlockedByNetworkPolicy",
                "spec.inferencePool is enabled behind a router, and the NetworkPolicy admits "
                "only this deployment's pods to the engines' HTTP port: list the inference "
                "gateway in spec.networkPolicy.httpFrom",
            )
        )
    return warnings


def validate_spec(spec: dict[str, Any], config: OperatorConfig = DEFAULT_CONFIG) -> None:
    """Raise SpecError naming the first invalid field of an AtomDeployment spec; `config` is
    what the operator's installation allows (env references)."""
    if not isinstance(spec, dict):
        raise SpecError("spec", f"must be an object, got {_type_name(spec)}")
    model = spec.get("model")
    if isinstance(model, dict) and "uri" in model:
        parse_model_uri(model["uri"])
    _check_schema(spec, SPEC_SCHEMA, "spec")
    defaulted = apply_defaults(spec)
    _check_cross_fields(defaulted)
    _check_python_only(defaulted, config)

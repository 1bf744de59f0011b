"""AtomDeployment spec: what its fields mean, and its defaults.

`apply_defaults` fills the CRD's static defaults (read from `schema.SPEC_SCHEMA`, so the two cannot
disagree) and then the defaults that depend on another field (`DERIVED_DEFAULTS`). Validation
is `atom_operator.validation.validate_spec`.
"""

from __future__ import annotations

import copy
from typing import Any

from atom_operator.model_source import DEFAULT_MODEL_NAME, default_model_name
from atom_operator.schema import SPEC_SCHEMA
from atom_operator.spec_error import SpecError

ROLES = ("decode", "prefill")
VENDORS = ("amd", "nvidia", "cpu")
VENDOR_RESOURCE = {"amd": "amd.com/gpu", "nvidia": "nvidia.com/gpu", "cpu": ""}
DEFAULT_IMAGES = {
    "amd": "ghcr.io/atom-serving/atom-runtime:0.1.0-rocm",
    "nvidia": "ghcr.io/atom-serving/atom-runtime:0.1.0-cuda",
    "cpu": "ghcr.io/atom-serving/atom-runtime:0.1.0-cpu",
}
# The group that owns /dev/kfd and /dev/dri/* on common distributions; the render group's id
# differs between distributions, so it is left to spec.accelerator.supplementalGroups.
AMD_VIDEO_GID = 44
DEFAULT_CONNECTOR = "AtomPortableConnector"
# Variables the operator sets itself, and why a user may not.
RESERVED_ENV = {
    "POD_IP": "the KV-event endpoints and topic use the pod IP",
    "ATOM_API_KEY": "set from spec.engine.apiKeySecretRef",
    "ATOM_TRANSFER_KEY_FILE": "the per-deployment KV-transfer key the operator mounts",
}

# Defaults a CRD cannot express because they depend on another field; filled by apply_defaults.
DERIVED_DEFAULTS = {
    "model.name": "the repo id for hf:// and source.huggingface, the last path segment for "
    "pvc, file and image (else the claim, or the image's name), "
    f"{DEFAULT_MODEL_NAME} when the model has no location",
    "engine.image": "the runtime image for accelerator.vendor (DEFAULT_IMAGES)",
    "accelerator.tolerations": "tolerate the vendor's GPU taint (Exists, NoSchedule); none for cpu",
    "accelerator.supplementalGroups": f"[{AMD_VIDEO_GID}] (video) for amd, [] otherwise",
    "kvTransfer": f"{{connector: {DEFAULT_CONNECTOR}, config: {{}}}} when prefill is present",
    "router.enabled": "true when prefill is present (disaggregated mode needs the router), "
    "false otherwise",
    "router.image": "spec.engine.image",
}


def has_router(spec: dict[str, Any]) -> bool:
    """Whether the AtomDeployment runs `atom router` in front of its engine pods:
    spec.router.enabled, which defaults to whether a prefill role exists. Safe on a raw or
    invalid spec (status folds those too)."""
    router = spec.get("router")
    enabled = router.get("enabled") if isinstance(router, dict) else None
    if isinstance(enabled, bool):
        return enabled
    return "prefill" in spec


def vendor_resource(accelerator: dict[str, Any]) -> str:
    """The extended resource a pod requests per GPU; "" for the cpu vendor."""
    return accelerator.get("resourceName") or VENDOR_RESOURCE[accelerator.get("vendor", "amd")]


def vendor_tolerations(vendor: str) -> list[dict[str, Any]]:
    resource = VENDOR_RESOURCE.get(vendor, "")
    if not resource:
        return []
    return [{"key": resource, "operator": "Exists", "effect": "NoSchedule"}]


# --- defaults ---------------------------------------------------------------------------------


def _fill_schema_defaults(value: Any, schema: dict[str, Any]) -> None:
    """Kubernetes structural defaulting, in place: missing properties take their `default`,
    then defaulting continues inside (so `default: {}` on an object fills its children)."""
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                _fill_schema_defaults(value[name], sub)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for name in value:
                _fill_schema_defaults(value[name], extra)
    elif isinstance(value, list) and "items" in schema:
        for item in value:
            _fill_schema_defaults(item, schema["items"])


def _section(spec: dict[str, Any], name: str) -> dict[str, Any]:
    """spec[name] when it is an object; a throwaway {} otherwise (validate_spec reports it)."""
    value = spec.get(name)
    return value if isinstance(value, dict) else {}


def apply_defaults(spec: dict[str, Any]) -> dict[str, Any]:
    """A new spec with every default filled: the CRD's static ones, then DERIVED_DEFAULTS.

    Pure, and safe on an invalid spec (a field of the wrong type is left as it is, for
    validate_spec to report); the input is never modified.
    """
    if not isinstance(spec, dict):
        raise TypeError(f"spec must be a dict, got {type(spec).__name__}")
    out = copy.deepcopy(spec)
    _fill_schema_defaults(out, SPEC_SCHEMA)
    model, engine = _section(out, "model"), _section(out, "engine")
    accelerator, router = _section(out, "accelerator"), _section(out, "router")
    vendor = accelerator.get("vendor")
    vendor_known = isinstance(vendor, str) and vendor in VENDORS
    if "name" not in model:
        try:
            model["name"] = default_model_name(model)
        except (SpecError, KeyError, TypeError, AttributeError):
            pass  # validate_spec reports the uri or source; leave the name unset
    if "image" not in engine and vendor_known:
        engine["image"] = DEFAULT_IMAGES[vendor]
    if "tolerations" not in accelerator and vendor_known:
        accelerator["tolerations"] = vendor_tolerations(vendor)
    if "supplementalGroups" not in accelerator and vendor_known:
        accelerator["supplementalGroups"] = [AMD_VIDEO_GID] if vendor == "amd" else []
    if "prefill" in out and "kvTransfer" not in out:
        out["kvTransfer"] = {"connector": DEFAULT_CONNECTOR, "config": {}}
    if "enabled" not in router:
        router["enabled"] = "prefill" in out
    if "image" not in router and "image" in engine:
        router["image"] = engine["image"]
    return out

"""Names, labels, selectors and metadata of the objects an AtomDeployment becomes."""

from __future__ import annotations

import hashlib
import re
from typing import Any

from atom_operator.schema import API_VERSION, KIND
from atom_operator.spec import ROLES, apply_defaults

ROUTER = "router"
DEPLOYMENT_LABEL = "serving.atom.dev/deployment"
ROLE_LABEL = "serving.atom.dev/role"
ENGINE_CONTAINER = "engine"
ENGINE_TYPE = "atom"  # llm-d.ai/engine-type: our metrics carry the atom: prefix, not vllm:
_MAX_NAME = 63
_HASH_LEN = 8


def short_hash(text: str) -> str:
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
    return f"{base}-{short_hash(name)}{tail}"


def label_value(text: str) -> str:
    """`text` as a label value: kept when valid, else truncated to 63 chars with a hash."""
    if len(text) <= _MAX_NAME and re.fullmatch(
        r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?", text
    ):
        return text
    clean = re.sub(r"[^A-Za-z0-9_.-]", "-", text)
    base = clean[: _MAX_NAME - _HASH_LEN - 1].strip("-_.")
    return f"{base}-{short_hash(text)}"


def name_of(body: dict[str, Any]) -> str:
    return body["metadata"]["name"]


def namespace_of(body: dict[str, Any]) -> str | None:
    return body["metadata"].get("namespace")


def role_selector(body: dict[str, Any], role: str) -> dict[str, str]:
    """matchLabels of one role's pods (decode, prefill or router); immutable once created."""
    return {DEPLOYMENT_LABEL: label_value(name_of(body)), ROLE_LABEL: role}


def role_selector_string(body: dict[str, Any], role: str) -> str:
    """The same selector as a string, for status.roles.<role>.selector (the scale subresource)."""
    return ",".join(f"{key}={value}" for key, value in role_selector(body, role).items())


def common_labels(body: dict[str, Any]) -> dict[str, str]:
    """Labels on every child; `serving.atom.dev/deployment` finds them all for pruning."""
    instance = label_value(name_of(body))
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
            "name": name_of(body),
            "uid": uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]


def child_metadata(body: dict[str, Any], name: str, labels: dict[str, str]) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name}
    if namespace_of(body):
        metadata["namespace"] = namespace_of(body)
    metadata["labels"] = labels
    owners = owner_references(body)
    if owners:
        metadata["ownerReferences"] = owners
    return metadata


def defaulted_spec(body: dict[str, Any]) -> dict[str, Any]:
    return apply_defaults(body.get("spec") or {})


def service_host(body: dict[str, Any], service: str) -> str:
    return f"{service}.{namespace_of(body) or 'default'}.svc.cluster.local"


def endpoint_url(body: dict[str, Any]) -> str:
    """The OpenAI base URL of the user-facing Service, from inside the cluster."""
    port = defaulted_spec(body)["service"]["port"]
    return f"http://{service_host(body, child_name(body))}:{port}/v1"


def is_disaggregated(spec: dict[str, Any]) -> bool:
    return "prefill" in spec

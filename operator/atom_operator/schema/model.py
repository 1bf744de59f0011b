"""spec.model: what to serve and where the engine finds it (`uri`, or `source`)."""

from __future__ import annotations

from atom_operator.schema.api import (
    HF_REPO_PATTERN,
    HF_REVISION_PATTERN,
    IMAGE_PATTERN,
    MODEL_NAME_MAX,
    MODEL_NAME_PATTERN,
    MODEL_URI_PATTERN,
    OBJECT_NAME_PATTERN,
    RELATIVE_PATH_PATTERN,
)
from atom_operator.schema.fields import QUANTITY, object_field, secret_key_ref, str_field


def _claim(description: str) -> dict:
    return object_field(
        description,
        {"claimName": str_field("Claim name.", minLength=1, pattern=OBJECT_NAME_PATTERN)},
        required=["claimName"],
    )


_RELATIVE_PATH = str_field(
    "Path of the model directory inside, relative; omitted => the root.",
    pattern=RELATIVE_PATH_PATTERN,
)

HUGGINGFACE = object_field(
    "Download from the Hugging Face Hub once, into a model-cache claim the replicas share: an "
    "init container runs `hf download` (progress in its log: kubectl logs <pod> -c "
    "model-download), then the engine reads the local files (--model <mount path>). Give an "
    "existing claim (cachePVC) or a size for the operator to create <name>-model-cache.",
    {
        "repo": str_field("Repo id, e.g. deepseek-ai/DeepSeek-R1.", pattern=HF_REPO_PATTERN),
        "revision": str_field(
            "Branch, tag or commit; omitted => the repo's default branch.",
            pattern=HF_REVISION_PATTERN,
        ),
        "tokenSecret": secret_key_ref(
            "Secret key holding a Hugging Face token (HF_TOKEN of the download step only).",
            "HF_TOKEN",
        ),
        "cachePVC": _claim(
            "An existing claim to download into (ReadWriteMany for replicas on several nodes)."
        ),  # fmt: skip
        "size": {
            **QUANTITY,
            "description": "Create the claim <name>-model-cache of this size (once; it is "
            "never resized or re-specified, and is deleted with the AtomDeployment).",
        },
        "storageClassName": str_field("With size: the claim's storage class.", minLength=1),
        "accessMode": str_field(
            "With size: the claim's access mode.",
            default="ReadWriteMany",
            enum=["ReadWriteMany", "ReadWriteOnce", "ReadWriteOncePod"],
        ),
    },
    required=["repo"],
    **{
        "x-kubernetes-validations": [
            {
                "rule": "has(self.cachePVC) != has(self.size)",
                "message": "give exactly one of cachePVC (an existing claim) and size (the "
                "operator creates one)",
                "fieldPath": ".size",
            },
            {
                "rule": "has(self.size) || !has(self.storageClassName)",
                "message": "storageClassName is for the claim the operator creates (size)",
                "fieldPath": ".storageClassName",
            },
        ]
    },
)

SOURCE = object_field(
    "Where the model files come from: exactly one of pvc, huggingface, image. Mounted "
    "read-only at /mnt/models in every engine pod. Excludes uri.",
    {
        "pvc": object_field(
            "An existing claim holding the model.",
            {
                "claimName": str_field("Claim name.", minLength=1, pattern=OBJECT_NAME_PATTERN),
                "path": _RELATIVE_PATH,
            },
            required=["claimName"],
        ),
        "huggingface": HUGGINGFACE,
        "image": object_field(
            "An OCI image holding the model files, mounted as a Kubernetes image volume "
            "(beta in 1.33, the ImageVolume feature gate; GA in 1.35).",
            {
                "reference": str_field("Image reference.", minLength=1, pattern=IMAGE_PATTERN),
                "pullPolicy": str_field(
                    "Image pull policy.",
                    default="IfNotPresent",
                    enum=["Always", "IfNotPresent", "Never"],
                ),
                "path": _RELATIVE_PATH,
            },
            required=["reference"],
        ),
    },
    **{
        "x-kubernetes-validations": [
            {
                "rule": "(has(self.pvc) ? 1 : 0) + (has(self.huggingface) ? 1 : 0) "
                "+ (has(self.image) ? 1 : 0) == 1",
                "message": "give exactly one of pvc, huggingface, image",
                "fieldPath": ".pvc",
            }
        ]
    },
)

MODEL = object_field(
    "The model to serve. Omit uri and source to serve the runtime's bundled default model "
    "(SmolLM2-135M-Instruct).",
    {
        "uri": str_field(
            "hf://<org>/<repo> (the engine downloads it at start), pvc://<claim>/<path> or "
            "file:///<path in the image>. Excludes source.",
            pattern=MODEL_URI_PATTERN,
        ),
        "source": SOURCE,
        "name": str_field(
            "Served model name (OpenAI `model`, KV-event topic). Default: the repo id "
            "for hf:// and huggingface, the last path segment otherwise. Letters, digits and "
            "_./:+- only, not starting with - (it is passed as a flag value).",
            minLength=1,
            maxLength=MODEL_NAME_MAX,
            pattern=MODEL_NAME_PATTERN,
        ),
        "authSecretRef": secret_key_ref(
            "Secret key holding a Hugging Face token, exposed to the engine as HF_TOKEN "
            "(uri hf://; source.huggingface has its own tokenSecret).",
            "HF_TOKEN",
        ),
    },
    default={},
    **{
        "x-kubernetes-validations": [
            {
                "rule": "!has(self.uri) || !has(self.source)",
                "message": "give model.uri or model.source, not both",
                "fieldPath": ".source",
            }
        ]
    },
)

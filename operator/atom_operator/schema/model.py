"""spec.model: what to serve and where the engine finds it."""

from __future__ import annotations

from atom_operator.schema.api import MODEL_NAME_MAX, MODEL_NAME_PATTERN, MODEL_URI_PATTERN
from atom_operator.schema.fields import object_field, secret_key_ref, str_field

MODEL = object_field(
    "The model to serve. Omit `uri` to serve the runtime's bundled default model "
    "(SmolLM2-135M-Instruct).",
    {
        "uri": str_field(
            "hf://<org>/<repo>, pvc://<claim>/<path> or file:///<path in the image>.",
            pattern=MODEL_URI_PATTERN,
        ),
        "name": str_field(
            "Served model name (OpenAI `model`, KV-event topic). Default: the repo id "
            "for hf://, the last path segment otherwise. Letters, digits and _./:+- only, "
            "not starting with - (it is passed as a flag value).",
            minLength=1,
            maxLength=MODEL_NAME_MAX,
            pattern=MODEL_NAME_PATTERN,
        ),
        "authSecretRef": secret_key_ref(
            "Secret key holding a Hugging Face token, exposed to the engine as HF_TOKEN.",
            "HF_TOKEN",
        ),
    },
    default={},
)

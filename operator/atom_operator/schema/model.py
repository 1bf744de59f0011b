"""spec.model: what to serve and where the engine finds it."""

from __future__ import annotations

from atom_operator.schema.api import MODEL_URI_PATTERN
from atom_operator.schema.fields import object_field, str_field

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
            "for hf://, the last path segment otherwise.",
            minLength=1,
        ),
        "authSecretRef": object_field(
            "Secret key holding a Hugging Face token, exposed to the engine as HF_TOKEN.",
            {
                "name": str_field("Secret name.", minLength=1),
                "key": str_field("Key in the Secret.", default="HF_TOKEN", minLength=1),
            },
            required=["name"],
        ),
    },
    default={},
)

"""The spec.engine fields that choose how the engine computes: weight and KV-cache precision,
speculative decoding, the reasoning parser, and where compiled kernels are kept. Each becomes
one `atom serve` flag with vLLM's name (render/engine_args.py)."""

from __future__ import annotations

from typing import Any

from atom_operator.schema.api import DRAFT_MODEL_PATTERN, OBJECT_NAME_PATTERN
from atom_operator.schema.fields import QUANTITY, int_field, object_field, str_field

QUANTIZATIONS = ["fp8"]
KV_CACHE_DTYPES = ["auto", "fp8", "fp8_e4m3"]
SPECULATIVE_METHODS = ["ngram", "draft_model", "mtp"]
REASONING_PARSERS = ["deepseek_r1", "qwen3", "gpt_oss"]

SPECULATIVE = object_field(
    "Speculative decoding (`--speculative-config`, vLLM's fields), on the decode role only "
    "(prefill produces one token per request). ngram: prompt lookup, no extra weights; "
    "draft_model: a smaller model of the same tokenizer; mtp: the MTP layers a checkpoint "
    "carries (DeepSeek-V3/R1, Qwen3.5, Qwen3-Next).",
    {
        "method": str_field("How draft tokens are proposed.", enum=list(SPECULATIVE_METHODS)),
        "numSpeculativeTokens": int_field(
            "Draft tokens proposed per step (num_speculative_tokens).", minimum=1, maximum=16
        ),
        "model": str_field(
            "method draft_model: the draft model, a Hugging Face repo id or an absolute path "
            "in the pod.",
            pattern=DRAFT_MODEL_PATTERN,
        ),
        "promptLookupMin": int_field(
            "method ngram: the shortest n-gram matched in the prompt.", minimum=1, maximum=64
        ),
        "promptLookupMax": int_field(
            "method ngram: the longest n-gram matched in the prompt.", minimum=1, maximum=64
        ),
        "draftTensorParallelSize": int_field(
            "methods draft_model and mtp: the drafting model's tensor-parallel size; only 1 (it "
            "runs whole on rank 0's GPU).",
            minimum=1,
            maximum=1,
        ),
    },
    required=["method", "numSpeculativeTokens"],
    **{
        "x-kubernetes-validations": [
            {
                "rule": "self.method != 'draft_model' || has(self.model)",
                "message": "method draft_model needs model (the draft model)",
                "fieldPath": ".model",
            },
            {
                "rule": "self.method == 'draft_model' || !has(self.model)",
                "message": "model is for method draft_model (ngram and mtp use the served model)",
                "fieldPath": ".model",
            },
            {
                "rule": "self.method == 'ngram' "
                "|| (!has(self.promptLookupMin) && !has(self.promptLookupMax))",
                "message": "promptLookupMin and promptLookupMax are for method ngram",
                "fieldPath": ".promptLookupMin",
            },
            {
                "rule": "!has(self.promptLookupMin) || !has(self.promptLookupMax) "
                "|| self.promptLookupMin <= self.promptLookupMax",
                "message": "promptLookupMin must be <= promptLookupMax",
                "fieldPath": ".promptLookupMax",
            },
            {
                "rule": "self.method != 'ngram' || !has(self.draftTensorParallelSize)",
                "message": "draftTensorParallelSize is for a drafting model (draft_model, mtp)",
                "fieldPath": ".draftTensorParallelSize",
            },
        ]
    },
)

COMPILE_CACHE = object_field(
    "Where compiled kernels and autotune results are kept (`--compile-cache-dir "
    "/var/cache/atom/compile`, mounted in every engine pod): an emptyDir of sizeLimit by "
    "default (kept across container restarts), or an existing claim shared by the replicas "
    "(kept across pods: ReadWriteMany for replicas on several nodes).",
    {
        "pvc": object_field(
            "An existing PersistentVolumeClaim to keep the cache in.",
            {"claimName": str_field("Claim name.", minLength=1, pattern=OBJECT_NAME_PATTERN)},
            required=["claimName"],
        ),
        "sizeLimit": {
            **QUANTITY,
            "default": "10Gi",
            "description": "Size limit of the emptyDir (without pvc).",
        },
    },
    default={},
)

ENGINE_FEATURES: dict[str, Any] = {
    "quantization": str_field(
        "Quantize a bf16/fp16 checkpoint's weights at load (`--quantization`): fp8 = "
        "per-channel FP8 weights, dynamic per-token activations. Omit for a checkpoint that is "
        "already FP8 (its own quantization_config is read).",
        enum=list(QUANTIZATIONS),
    ),
    "kvCacheDtype": str_field(
        "KV-cache element type (`--kv-cache-dtype`): auto = the model's dtype; fp8 / fp8_e4m3 "
        "halve what decode attention reads. Omitted => the engine's default (auto).",
        enum=list(KV_CACHE_DTYPES),
    ),
    "speculative": SPECULATIVE,
    "reasoningParser": str_field(
        "Put the model's thinking in `reasoning_content` (`--reasoning-parser`, vLLM's names).",
        enum=list(REASONING_PARSERS),
    ),
    "compileCache": COMPILE_CACHE,
}

"""spec.engine's compute choices (FP8 weights and KV cache, speculative decoding, the reasoning
parser, the compile cache): each lands as vLLM's flag, exactly, on the right roles. The CRD and
validate_spec refusing the same broken combinations is in test_crd.py's tables."""

from __future__ import annotations

import json
from typing import Any

import pytest

from atom_operator.render.roles import render_role_deployment


def atomd(engine: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "serving.atom.dev/v1alpha1",
        "kind": "AtomDeployment",
        "metadata": {"name": "m", "namespace": "llm", "uid": "u-1"},
        "spec": {"model": {"uri": "hf://Qwen/Qwen3-8B"}, "engine": engine, **spec},
    }


def args_of(body: dict[str, Any], role: str = "decode") -> list[str]:
    (container,) = render_role_deployment(body, role)["spec"]["template"]["spec"]["containers"]
    return container["args"]


def value(args: list[str], flag: str) -> str:
    assert args.count(flag) == 1, (flag, args)
    return args[args.index(flag) + 1]


def test_precision_and_parser_flags():
    args = args_of(atomd({"quantization": "fp8", "kvCacheDtype": "fp8_e4m3",
                          "reasoningParser": "deepseek_r1"}))  # fmt: skip
    assert value(args, "--quantization") == "fp8"
    assert value(args, "--kv-cache-dtype") == "fp8_e4m3"
    assert value(args, "--reasoning-parser") == "deepseek_r1"
    # Omitted fields render no flag: the engine's own defaults (auto KV dtype, no parser).
    plain = args_of(atomd({}))
    for flag in ("--quantization", "--kv-cache-dtype", "--reasoning-parser",
                 "--speculative-config"):  # fmt: skip
        assert flag not in plain


@pytest.mark.parametrize(
    ("speculative", "config"),
    [
        ({"method": "ngram", "numSpeculativeTokens": 4, "promptLookupMin": 2,
          "promptLookupMax": 5},
         {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
          "prompt_lookup_max": 5}),
        ({"method": "draft_model", "numSpeculativeTokens": 3, "model": "Qwen/Qwen3-0.6B",
          "draftTensorParallelSize": 1},
         {"method": "draft_model", "num_speculative_tokens": 3, "model": "Qwen/Qwen3-0.6B",
          "draft_tensor_parallel_size": 1}),
        ({"method": "mtp", "numSpeculativeTokens": 1},
         {"method": "mtp", "num_speculative_tokens": 1}),
    ],
    ids=["ngram", "draft-model", "mtp"],
)  # fmt: skip
def test_speculative_config_uses_vllm_field_names_on_decode_only(speculative, config):
    body = atomd({"speculative": speculative}, prefill={})
    assert json.loads(value(args_of(body), "--speculative-config")) == config
    assert "--speculative-config" not in args_of(body, "prefill")


def test_compile_cache_is_a_volume_in_every_engine_pod():
    for engine, volume in [
        ({}, {"name": "compile-cache", "emptyDir": {"sizeLimit": "10Gi"}}),
        ({"compileCache": {"sizeLimit": "40Gi"}},
         {"name": "compile-cache", "emptyDir": {"sizeLimit": "40Gi"}}),
        ({"compileCache": {"pvc": {"claimName": "kernels"}}},
         {"name": "compile-cache", "persistentVolumeClaim": {"claimName": "kernels"}}),
    ]:  # fmt: skip
        for role in ("decode", "prefill"):
            deployment = render_role_deployment(atomd(engine, prefill={}), role)
            pod = deployment["spec"]["template"]["spec"]
            (container,) = pod["containers"]
            assert volume in pod["volumes"]
            assert {"name": "compile-cache", "mountPath": "/var/cache/atom/compile"} in (
                container["volumeMounts"]
            )
            assert value(container["args"], "--compile-cache-dir") == "/var/cache/atom/compile"
            env = {var["name"]: var.get("value") for var in container["env"]}
            assert env["TRITON_CACHE_DIR"] == "/var/cache/atom/compile/triton"

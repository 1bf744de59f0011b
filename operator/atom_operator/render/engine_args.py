"""The `atom serve` command line of an engine pod, flag by flag, from a defaulted spec."""

from __future__ import annotations

import json
from typing import Any

from atom_operator.render.keys import KEYS_MOUNT
from atom_operator.render.kubelet_expansion import literal, reference
from atom_operator.render.model_volume import model_argument
from atom_operator.render.names import is_disaggregated
from atom_operator.schema import ENGINE_HTTP_PORT

API_KEY_ENV = "ATOM_API_KEY"
POD_IP_ENV = "POD_IP"
# Compiled kernels and autotune results (the compile-cache volume, render/engine_pod.py).
COMPILE_CACHE_DIR = "/var/cache/atom/compile"


def _json_arg(value: dict[str, Any]) -> str:
    return json.dumps(value, separators=(",", ":"))


def kv_events_config(spec: dict[str, Any]) -> dict[str, Any]:
    """--kv-events-config: PUB and replay sockets bound to the pod's own address (never `*`);
    the topic names this pod and model. $(POD_IP) is expanded by the kubelet from the
    container's POD_IP variable."""
    events = spec["kvEvents"]
    pod_ip = reference(POD_IP_ENV)
    config: dict[str, Any] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://{pod_ip}:{events['port']}",
        "replay_endpoint": f"tcp://{pod_ip}:{events['replayPort']}",
        "topic": f"kv@{pod_ip}:{events['port']}@{literal(spec['model']['name'])}",
    }
    if not events["includeTokenIds"]:
        config["include_token_ids"] = False
    if events["encryption"] == "curve":
        config["curve_keys_dir"] = KEYS_MOUNT
    return config


def kv_transfer_config(spec: dict[str, Any], role: str) -> dict[str, Any]:
    """--kv-transfer-config: prefill produces KV, decode consumes it."""
    transfer = spec["kvTransfer"]
    return {
        "kv_connector": transfer["connector"],
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "kv_connector_extra_config": transfer["config"],
    }


def _user_json(value: dict[str, Any]) -> str:
    """A JSON flag value made only of user data: escaped whole for the kubelet."""
    return literal(_json_arg(value))


def speculative_config(spec: dict[str, Any]) -> dict[str, Any] | None:
    """--speculative-config with vLLM's field names, or None without spec.engine.speculative."""
    speculative = spec["engine"].get("speculative")
    if speculative is None:
        return None
    names = {
        "method": "method",
        "numSpeculativeTokens": "num_speculative_tokens",
        "model": "model",
        "promptLookupMin": "prompt_lookup_min",
        "promptLookupMax": "prompt_lookup_max",
        "draftTensorParallelSize": "draft_tensor_parallel_size",
    }
    return {vllm: speculative[ours] for ours, vllm in names.items() if ours in speculative}


def compute_args(spec: dict[str, Any], role: str) -> list[str]:
    """The flags of spec.engine's compute choices (schema/engine_features.py); speculation on
    the decode role only (prefill produces one token per request)."""
    engine = spec["engine"]
    args = ["--compile-cache-dir", COMPILE_CACHE_DIR]
    for field, flag in (("quantization", "--quantization"), ("kvCacheDtype", "--kv-cache-dtype"),
                        ("reasoningParser", "--reasoning-parser")):  # fmt: skip
        if field in engine:
            args += [flag, engine[field]]
    speculative = speculative_config(spec)
    if speculative is not None and role == "decode":
        args += ["--speculative-config", _user_json(speculative)]
    return args


def serve_args(spec: dict[str, Any], role: str) -> list[str]:
    """`atom serve` arguments for one role of a defaulted spec; user args come last and win.
    Every user string is escaped for the kubelet (`literal`); only the operator's own
    references ($(POD_IP), $(ATOM_API_KEY)) are expanded."""
    role_spec = spec[role]
    args = ["serve", "--host", "0.0.0.0", "--port", str(ENGINE_HTTP_PORT)]
    model = model_argument(spec)
    if model is not None:
        args += ["--model", literal(model)]
    args += ["--served-model-name", literal(spec["model"]["name"])]
    args += ["--block-size", str(spec["engine"]["blockSize"])]
    if "maxModelLen" in spec["engine"]:
        args += ["--max-model-len", str(spec["engine"]["maxModelLen"])]
    args += ["--tensor-parallel-size", str(role_spec["tensorParallelSize"])]
    args += compute_args(spec, role)
    if spec["kvEvents"]["enabled"]:
        args += ["--kv-events-config", _json_arg(kv_events_config(spec))]
    checkpoint = spec["stateCheckpoint"]
    args += ["--state-checkpoint-interval-tokens", str(checkpoint["intervalTokens"])]
    args.append(
        "--state-checkpoint-demand" if checkpoint["demand"] else "--no-state-checkpoint-demand"
    )
    args += ["--state-checkpoint-memory-fraction", f"{checkpoint['memoryFraction']:g}"]
    if is_disaggregated(spec):
        args += ["--kv-transfer-config", _user_json(kv_transfer_config(spec, role))]
    if spec["engine"].get("apiKeySecretRef"):
        # The kubelet expands $(ATOM_API_KEY) from the Secret-backed variable: the key never
        # appears in the pod spec.
        args += ["--api-key", reference(API_KEY_ENV)]
    user_args = list(spec["engine"]["args"]) + list(role_spec["args"])
    return args + [literal(arg) for arg in user_args]

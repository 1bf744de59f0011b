"""Small random Hugging Face models on disk, the reference for the engine's outputs.

Each is written with `transformers` (config.json + safetensors) next to the default model's
tokenizer (rebuilt from the SmolLM2 GGUF and saved as tokenizer.json), so the same folder serves
the engine, the server and transformers itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 49152  # the SmolLM2 tokenizer's vocabulary

CONFIGS = {
    "llama": dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
    "llama3": dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        tie_word_embeddings=True,
    ),
    "qwen2": dict(
        model_type="qwen2",
        architectures=["Qwen2ForCausalLM"],
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
    ),
    "qwen3": dict(
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
    ),
}


def make_tiny_model(folder: Path, kind: str, seed: int = 0) -> Path:
    """Write a random `kind` model (see CONFIGS) to folder; returns the folder."""
    import transformers

    from atom_runtime.models.loader import default_model_path
    from atom_runtime.tokenizer import Tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    spec = dict(CONFIGS[kind])
    spec.update(vocab_size=VOCAB, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2)
    model_type = spec.pop("model_type")
    spec.pop("architectures")
    config = transformers.AutoConfig.for_model(model_type, **spec)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    # Wider weights than the default init so greedy tokens are decided by clear margins.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.08)
    model.save_pretrained(folder, safe_serialization=True)
    try:
        tok = Tokenizer.from_gguf(default_model_path())
    except FileNotFoundError:
        return folder  # no default model here (e.g. a bare GPU box): token-id prompts only
    tok.hf.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": tok.bos_token,
                "eos_token": tok.eos_token,
                "add_bos_token": False,
                "chat_template": tok.chat_template,
            }
        )
    )
    return folder

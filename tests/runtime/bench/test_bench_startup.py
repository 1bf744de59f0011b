"""`atom bench startup` on CPU with a small config: it writes the checkpoint (every tensor the
engine needs, sharded, with a tokenizer), drops it from the page cache, and measures each load
format, in one run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ATOM = Path(sys.executable).parent / "atom"
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "eos_token_id": 2, "bos_token_id": 1,
}  # fmt: skip


def test_bench_startup_writes_a_sharded_checkpoint_and_measures_each_format(tmp_path):
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(CONFIG))
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [str(ATOM), "bench", "startup", "--model", str(tmp_path / "cfg"),
         "--dir", str(tmp_path / "ckpt"), "--shard-gb", "0.01", "--no-serve", "--keep",
         "--load-formats", "safetensors,auto,no_such_format", "--output-json", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())
    assert [r["load_format"] for r in rows] == ["safetensors", "auto", "no_such_format"]
    for row in rows[:2]:
        assert row["read_gb_per_s"] > 0 and row["load_s"] > 0
        assert row["page_cache_dropped"] in ("all", "files")
    assert "load_error" in rows[2]
    shards = sorted((tmp_path / "ckpt").glob("*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "ckpt" / "tokenizer.json").is_file()
    index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())
    assert {"lm_head.weight", "model.layers.1.mlp.down_proj.weight"} <= index["weight_map"].keys()


def test_the_default_model_shape_is_written_as_a_llama_config():
    """`--model default` (what a CPU-only user measures): a config.json whose architecture is the
    default model's GGUF, so the written checkpoint serves with that model's tokenizer."""
    from atom_runtime.bench.startup import checkpoint_config_text, checkpoint_tensors
    from atom_runtime.models.config import ModelConfig
    from atom_runtime.models.source import default_model_path, load_model_config

    written = ModelConfig.from_hf(json.loads(checkpoint_config_text("default")))
    gguf = load_model_config(default_model_path())
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim",
                 "max_position_embeddings", "tie_word_embeddings", "eos_token_ids"):  # fmt: skip
        assert getattr(written, name) == getattr(gguf, name), name
    assert written.rope_theta == gguf.rope_theta and written.model_type == "llama"
    params = sum(a * (b if len(s) > 1 else 1) for s in checkpoint_tensors(written).values()
                 for a, b in [(s[0], s[-1])])  # fmt: skip
    assert 130e6 < params < 140e6  # SmolLM2-135M


def test_a_qwen3_checkpoint_has_every_tensor_the_engine_loads(tmp_path):
    """Qwen3 (the QK-norm weights) and Qwen2 (attention biases) shapes load with no tensor
    missing, so the startup suite can time Qwen3-0.6B from real files."""
    from atom_runtime.bench.startup import measure_load, write_checkpoint
    from atom_runtime.models.config import ModelConfig

    for model_type in ("qwen3", "qwen2"):
        text = json.dumps({**CONFIG, "model_type": model_type, "head_dim": 32})
        cfg = ModelConfig.from_hf(json.loads(text))
        folder = tmp_path / model_type
        write_checkpoint(text, cfg, folder, shard_gb=1.0)
        row = measure_load(folder, cfg, "auto", __import__("torch").device("cpu"))
        assert "load_error" not in row and row["load_s"] > 0, (model_type, row)

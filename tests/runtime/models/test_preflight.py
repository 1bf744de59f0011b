"""Start-up checks from the config alone (models/preflight.py) and the GGUF header reader they use
(models/gguf.py)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from atom_runtime.models.config import ModelConfig
from atom_runtime.models.gguf import open_gguf
from atom_runtime.models.preflight import check_model, tensor_parallel_problem
from atom_runtime.models.source import default_model_path, load_model_config


def _config(**overrides) -> ModelConfig:
    base = dict(model_type="llama", vocab_size=100, hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # fmt: skip
    return ModelConfig(**{**base, **overrides})


def test_tensor_parallel_problem_names_the_width_that_does_not_divide():
    assert tensor_parallel_problem(_config(), 1) is None
    assert tensor_parallel_problem(_config(), 2) is None
    assert tensor_parallel_problem(_config(), 4) is None  # 2 KV heads, each on 2 ranks
    assert "attention heads (num_attention_heads) 4 is not divisible by 3" in (
        tensor_parallel_problem(_config(), 3)
    )
    assert "MLP width (intermediate_size) 100" in tensor_parallel_problem(
        _config(intermediate_size=100, num_attention_heads=8, num_key_value_heads=8), 8
    )
    assert "KV heads (num_key_value_heads) 6" in tensor_parallel_problem(
        _config(num_attention_heads=8, num_key_value_heads=6), 4
    )
    assert "cannot share 3 KV heads" in tensor_parallel_problem(
        _config(num_attention_heads=12, num_key_value_heads=3, intermediate_size=120), 4
    )


def test_check_model_refuses_before_loading_with_the_flag_named(tiny_models, tmp_path):
    folder = tiny_models["llama"]
    assert check_model(str(folder)).config.num_attention_heads == 4
    with pytest.raises(ValueError, match="tensor_parallel_size: 3 does not fit the model"):
        check_model(str(folder), tensor_parallel_size=3)
    with pytest.raises(ValueError, match="max_model_len: 5000 exceeds the model's context"):
        check_model(str(folder), max_model_len=5000)
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        check_model(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="tokenizer .*no such file"):
        check_model(str(folder), tokenizer=str(tmp_path / "no-tokenizer"))
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(folder / "config.json", bare / "config.json")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors weights .*dummy"):
        check_model(str(bare))
    assert check_model(str(bare), load_format="dummy").path == bare
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="broken/config.json: model_type 'gpt2' is not supported"):
        check_model(str(broken))


def test_the_default_model_is_checked_from_its_gguf_header():
    config = check_model(None, max_model_len=8192).config
    assert (config.model_type, config.num_attention_heads, config.max_position_embeddings) == (
        "llama", 9, 8192,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"attention heads \(num_attention_heads\) 9"):
        check_model(None, tensor_parallel_size=2)


@pytest.mark.slow
def test_gguf_header_reader_matches_the_gguf_library():
    """Every metadata field and tensor (name, shape, type, bytes) as gguf.GGUFReader reads
    them, from the default model's file."""
    import gguf

    path = default_model_path()
    ours, ref = open_gguf(path), gguf.GGUFReader(str(path))
    fields = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields == fields
    assert len(ours.tensors) == len(ref.tensors)
    for a, b in zip(ours.tensors, ref.tensors, strict=True):
        assert (a.name, list(a.shape), a.tensor_type) == (b.name, list(b.shape), b.tensor_type)
        assert a.data.shape == b.data.shape and a.data.dtype == b.data.dtype
        assert np.array_equal(a.data, b.data)
    assert load_model_config(path).vocab_size == 49152

"""FP8 in the decode bound and in the bench's resident weight line: FP8 linear layers count one
byte a weight plus their fp32 scales, an FP8 KV cache one byte a value (half the bf16 bytes a
token, twice the blocks in the same memory)."""

from __future__ import annotations

import pytest

from atom_runtime.bench import bound as bench_bound
from atom_runtime.layers import fp8_linear
from atom_runtime.llm import LLM
from tests.model_factory import CONFIGS, VOCAB
from tests.runtime.bench.test_bench_bound import _llama_layer_params

F32 = 4


def test_fp8_weights_count_one_byte_and_their_scales(tiny_models, monkeypatch):
    monkeypatch.setattr(fp8_linear, "runs_natively", lambda device: True)
    c = CONFIGS["llama"]
    llm = LLM(str(tiny_models["llama"]), dtype="float32", num_gpu_blocks_override=32,
              quantization="fp8")  # fmt: skip
    runner = llm.engine.executor
    db = bench_bound.decode_bytes(runner.model, runner)
    weights = bench_bound.resident_weights(runner.model)
    hidden, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    head_dim = hidden // c["num_attention_heads"]
    qkv_rows = (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * head_dim
    linear = qkv_rows * hidden + hidden * hidden + 3 * inter * hidden  # FP8, one byte each
    rows = qkv_rows + hidden + 2 * inter + hidden  # one fp32 scale per output row
    plain = layers * (_llama_layer_params(c) - linear) + hidden + VOCAB * hidden  # norms, head
    assert db.weights == layers * (linear + rows * F32) + plain * F32
    assert weights["fp8_bytes"] == layers * linear
    assert weights["scale_bytes"] == layers * rows * F32
    embedding = VOCAB * hidden * F32
    assert weights["bytes"] == db.weights + embedding
    assert "GiB FP8" in bench_bound.describe_weights(weights)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3"])
def test_an_fp8_kv_cache_halves_the_bytes_a_token_and_doubles_the_blocks(
    tiny_models, monkeypatch, kv_cache_dtype
):
    monkeypatch.setenv("ATOM_CPU_KVCACHE_SPACE", "0.01")
    plain = LLM(str(tiny_models["qwen3"]), dtype="float32")
    fp8 = LLM(str(tiny_models["qwen3"]), dtype="float32", kv_cache_dtype=kv_cache_dtype)
    a, b = plain.engine.executor, fp8.engine.executor
    # fp32 model: a float32 K/V value is 4 bytes, an FP8 one 1.
    assert a.bytes_per_block == 4 * b.bytes_per_block
    assert 4 * a.num_blocks <= b.num_blocks < 4 * (a.num_blocks + 1)  # the same space, floored
    assert bench_bound.decode_bytes(b.model, b).kv_per_token * 4 == (
        bench_bound.decode_bytes(a.model, a).kv_per_token
    )

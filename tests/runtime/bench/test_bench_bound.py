"""The decode workloads' bandwidth bound (bench_bound.py): the bytes a step moves, counted from a
real engine's model and cache and checked against the configs' arithmetic, and the bound's sums."""

from __future__ import annotations

import pytest
import torch

from atom_runtime.bench import bound as bench_bound
from atom_runtime.bench.bound import DecodeBytes
from atom_runtime.llm import LLM
from tests.model_factory import _HYBRID_COMMON, _MOE, CONFIGS, MLA_CONFIGS, VOCAB

F32 = 4


def _runner(llm):
    return llm.engine.executor


def _llama_layer_params(c: dict) -> int:
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    head_dim = hidden // c["num_attention_heads"]
    qkv = (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * head_dim * hidden
    o = hidden * c["num_attention_heads"] * head_dim
    return qkv + o + 3 * inter * hidden + 2 * hidden  # + gate, up, down and two norms


@pytest.mark.parametrize("kind", ["llama", "llama3"])  # untied and tied LM head
def test_dense_model_bytes_follow_from_its_config(tiny_models, kind):
    c = CONFIGS[kind]
    llm = LLM(str(tiny_models[kind]), dtype="float32", num_gpu_blocks_override=32)
    try:
        db = bench_bound.decode_bytes(_runner(llm).model, _runner(llm))
    finally:
        llm.shutdown()
    hidden = c["hidden_size"]
    layers = c["num_hidden_layers"]
    head = VOCAB * hidden  # read whole every step, tied or not
    expected = layers * _llama_layer_params(c) + hidden + head  # + the final norm
    assert db.weights == expected * F32
    tied = c["tie_word_embeddings"]
    assert db.embedding_row == (0 if tied else hidden * F32)
    head_dim = hidden // c["num_attention_heads"]
    assert db.kv_per_token == 2 * layers * c["num_key_value_heads"] * head_dim * F32
    assert db.state_per_seq == 0 and db.expert == 0 and db.experts_touched(256) == 0


def test_moe_hybrid_counts_routed_experts_apart_and_its_state(tiny_hybrid_models):
    llm = LLM(str(tiny_hybrid_models["qwen3_5_moe"]), dtype="float32", num_gpu_blocks_override=32)
    try:
        runner = _runner(llm)
        db = bench_bound.decode_bytes(runner.model, runner)
        total = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        slot_bytes = runner.state_bytes_per_slot
    finally:
        llm.shutdown()
    c = _HYBRID_COMMON | _MOE
    layers = c["num_hidden_layers"]  # every layer is MoE (decoder_sparse_step 1)
    per_expert = 3 * c["moe_intermediate_size"] * c["hidden_size"] * F32  # gate, up, down
    assert db.expert == layers * per_expert
    assert (db.num_experts, db.top_k) == (c["num_experts"], c["num_experts_per_tok"])
    # Everything else is read once a step, but for the untied embedding's other rows.
    embedding = VOCAB * c["hidden_size"] * F32
    assert db.weights == total - c["num_experts"] * db.expert - embedding
    # One full-attention layer of three holds K/V; the two linear layers hold state.
    assert db.kv_per_token == 2 * c["num_key_value_heads"] * c["head_dim"] * F32
    v_heads, dk, dv = c["linear_num_value_heads"], c["linear_key_head_dim"], 16
    recurrent = 2 * v_heads * dk * dv * 4  # fp32 delta-rule state per linear layer
    assert db.state_per_seq == slot_bytes and slot_bytes > recurrent


def test_deepseek_counts_the_latent_row_once_a_token(tiny_mla_models):
    """MLA's cache is one latent row (kv_lora_rank + rope) a token a layer, read once for every
    head; the routed experts of the MoE layers are counted apart from the shared ones."""
    c = MLA_CONFIGS["deepseek_v3"]
    llm = LLM(str(tiny_mla_models["deepseek_v3"]), dtype="float32", num_gpu_blocks_override=32)
    try:
        runner = _runner(llm)
        db = bench_bound.decode_bytes(runner.model, runner)
        total = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    finally:
        llm.shutdown()
    row = c["kv_lora_rank"] + c["qk_rope_head_dim"]
    assert db.kv_per_token == c["num_hidden_layers"] * row * F32
    moe_layers = c["num_hidden_layers"] - c["first_k_dense_replace"]
    assert db.expert == moe_layers * 3 * c["moe_intermediate_size"] * c["hidden_size"] * F32
    assert (db.num_experts, db.top_k) == (c["n_routed_experts"], c["num_experts_per_tok"])
    embedding = VOCAB * c["hidden_size"] * F32
    assert db.weights == total - c["n_routed_experts"] * db.expert - embedding


def test_expected_experts_touched_by_batch():
    db = DecodeBytes(
        0, 100, num_experts=256, top_k=8, embedding_row=0, kv_per_token=0, state_per_seq=0
    )
    assert db.experts_touched(1) == pytest.approx(8)
    assert db.experts_touched(2) == pytest.approx(256 * (1 - (1 - 8 / 256) ** 2))
    assert 255 < db.experts_touched(256) < 256
    assert db.step([5]) == pytest.approx(8 * 100)


def test_step_and_bounds_are_the_sums_they_claim():
    db = DecodeBytes(
        weights=10**9,
        expert=0,
        num_experts=0,
        top_k=0,
        embedding_row=10,
        kv_per_token=1000,
        state_per_seq=500,
    )
    # Two sequences at 100 and 200 tokens: their K/V read, one new token each written, state
    # read and written, one embedding row each.
    assert db.step([100, 200]) == 10**9 + 2 * 10 + 302 * 1000 + 2 * 2 * 500
    # W2 at 100 + 3: the timed steps are the 2nd and 3rd tokens, at contexts 101 and 102.
    bw = 1e12
    expected_ms = (db.step([101]) + db.step([102])) / 2 / bw * 1e3
    assert bench_bound.w2_bound_ms(db, 100, 3, bw) == pytest.approx(expected_ms)
    # W1 with one sequence at a time: two waves, each two decode steps, six tokens in all.
    seconds = sum(db.step([p + j]) for p in (10, 20) for j in (1, 2)) / bw
    assert bench_bound.w1_bound_tok_s(db, [10, 20], 3, 1, bw) == pytest.approx(6 / seconds)
    # Both at once: one wave, steps over both contexts.
    seconds = sum(db.step([10 + j, 20 + j]) for j in (1, 2)) / bw
    assert bench_bound.w1_bound_tok_s(db, [10, 20], 3, 256, bw) == pytest.approx(6 / seconds)


def test_copy_bandwidth_and_peak_on_this_device():
    device = torch.device("cpu")
    assert bench_bound.peak_bandwidth(device) is None
    assert bench_bound.copy_bandwidth(device, nbytes=1 << 24, repeats=2) > 1e8  # > 0.1 GB/s


def test_no_room_for_the_copy_leaves_out_its_figure(monkeypatch):
    """An engine that holds the whole GPU leaves no room for the copy's buffers: the bound is
    reported at the peak alone, and the benchmark still writes its result."""

    def full(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(torch, "empty", full)
    assert bench_bound.copy_bandwidth(torch.device("cpu")) is None
    monkeypatch.undo()
    db = DecodeBytes(10**6, 0, 0, 0, 0, 100, 0)
    line = bench_bound.describe(
        "latency",
        {"peak": {"bandwidth_GBps": 4800.0, "bound": bench_bound.w2_bound_ms(db, 8, 5, 4.8e12),
                  "atom_share_of_bound": 0.5}},
    )  # fmt: skip
    assert line.startswith("bound W2:") and "(peak)" in line and "copy" not in line


def test_a_hybrid_bound_is_given_for_both_recurrent_state_dtypes(tiny_hybrid_models):
    """The recurrent matrices' bytes are counted apart from the conv windows; an engine with
    `mamba_ssm_cache_dtype="bfloat16"` moves half of them, and the bound is reported (and
    printed) for an fp32 and a bf16 recurrent state whichever the engine ran."""
    c = _HYBRID_COMMON
    linear_layers = 2  # linear, full, linear
    recurrent = linear_layers * c["linear_num_value_heads"] * 16 * 16  # values a sequence
    by_dtype = {}
    for name in ("auto", "bfloat16"):
        llm = LLM(
            str(tiny_hybrid_models["qwen3_5"]),
            dtype="float32",
            num_gpu_blocks_override=32,
            mamba_ssm_cache_dtype=name,
        )
        try:
            runner = _runner(llm)
            by_dtype[name] = bench_bound.decode_bytes(runner.model, runner)
            report = bench_bound.report(llm.engine, "latency", 1.0, input_len=8, output_len=4)
        finally:
            llm.shutdown()
        assert report["by_recurrent_dtype"]["engine"] == (
            "bfloat16" if name != "auto" else "float32"
        )
        line = bench_bound.describe("latency", report)
        assert "recurrent state float32 / bfloat16" in line
    fp32, bf16 = by_dtype["auto"], by_dtype["bfloat16"]
    assert (fp32.recurrent_per_seq, bf16.recurrent_per_seq) == (recurrent * 4, recurrent * 2)
    assert fp32.recurrent_dtype == "float32" and bf16.recurrent_dtype == "bfloat16"
    assert fp32.state_per_seq - bf16.state_per_seq == recurrent * 2  # conv windows unchanged
    assert fp32.with_recurrent_dtype(torch.bfloat16) == bf16
    assert bf16.with_recurrent_dtype(torch.float32) == fp32
    # W2 moves less with the bf16 state: its bound (ms) is lower.
    assert bench_bound.w2_bound_ms(bf16, 8, 4, 1e9) < bench_bound.w2_bound_ms(fp32, 8, 4, 1e9)

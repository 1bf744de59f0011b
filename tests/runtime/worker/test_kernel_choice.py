"""The one-row projection paths the GPU takes at batch 1 when the GEMV wins (with the norm
fused into qkv/gate_up, SwiGLU into gate_up's epilogue, rotary + the cache store into qkv's, or
each in its own kernel) give what the cuBLAS path gives. On CPU the ops run
their torch references, so this checks the model's plumbing (the residual returned instead of
updated in place, the activation moved into the down projection); the Triton kernels behind
them are checked in tests/kernels/test_gemv.py."""

from __future__ import annotations

import pytest

from atom_runtime import LLM, SamplingParams
from atom_runtime.layers.linear import LinearBase
from atom_runtime.worker.kernel_choice import (
    choose_small_m_kernels,
    small_m_groups,
    small_m_paths,
    use_small_m_path,
)


@pytest.mark.parametrize(
    ("models", "kind"),
    [("tiny_models", "qwen3"), ("tiny_models", "qwen2"), ("tiny_models", "llama"),
     ("tiny_hybrid_models", "qwen3_5"), ("tiny_hybrid_models", "qwen3_5_moe")],
)  # fmt: skip
def test_fused_one_row_path_matches_the_unfused_one(request, models, kind):
    """Through every family's decoder layers (dense, hybrid, MoE with its own norm), the fused
    and unfused one-row paths give the cuBLAS path's tokens and log-probabilities."""
    folder = request.getfixturevalue(models)[kind]
    llm = LLM(str(folder), dtype="float32", num_gpu_blocks_override=64)
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=0, ignore_eos=True)
    prompt = {"prompt_token_ids": [3, 14, 15, 92, 65, 35]}
    want = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    layers = [m for m in llm.engine.executor.model.modules() if isinstance(m, LinearBase)]
    assert {m.norm_before for m in layers} == {True, False}
    assert any(m.act_after == "silu_mul" for m in layers)
    if kind in ("qwen3", "qwen2"):
        # Both qkv projections can take rotary + the cache store in; Qwen3's its QK-norm too.
        assert any(m.rope_after for m in layers)
        assert any(m.qk_norm_after for m in layers) == (kind == "qwen3")
    # The GEMV with the norm, activation and/or rotary inside it, or each in its own kernel.
    for fuse in [(1, 1, 0), (1, 0, 0), (0, 1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 1), (1, 1, 1),
                 (1, 0, 1)]:  # fmt: skip
        for m in layers:
            m.gemv = True
            m.fuse_norm, m.fuse_act, m.fuse_rope = map(bool, fuse)
        try:
            got = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        finally:
            for m in layers:
                m.gemv = m.fuse_norm = m.fuse_act = m.fuse_rope = False
        assert got.token_ids == want.token_ids
        for a, b in zip(got.logprobs, want.logprobs, strict=True):
            assert all(abs(a[t] - b[t]) < 1e-4 for t in a)


def test_no_kernel_choice_off_the_gpu(tiny_models):
    llm = LLM(str(tiny_models["qwen3"]), dtype="float32", num_gpu_blocks_override=16)
    assert choose_small_m_kernels(llm.engine.executor.model, llm.engine.executor.device) == {}
    assert llm.engine.executor.small_m_kernels == {}


def test_small_m_kernel_setting_is_checked(tiny_models, monkeypatch):
    llm = LLM(str(tiny_models["qwen3"]), dtype="float32", num_gpu_blocks_override=16)
    monkeypatch.setenv("ATOM_SMALL_M_KERNELS", "triton")
    with pytest.raises(ValueError, match="ATOM_SMALL_M_KERNELS='triton'"):
        choose_small_m_kernels(llm.engine.executor.model, llm.engine.executor.device)


def test_one_row_groups_and_their_paths(tiny_models):
    """Layers group by weight shape and what is in front of them; a group with a norm or an
    activation in front has the fused path too, and choosing a path sets both flags."""
    llm = LLM(str(tiny_models["qwen3"]), dtype="bfloat16", num_gpu_blocks_override=16)
    groups = small_m_groups(llm.engine.executor.model)
    config = llm.engine.executor.model_config
    layers = config.num_hidden_layers
    assert all(len(g) == layers for g in groups.values()) and len(groups) == 4
    paths = {k: small_m_paths(g[0]) for k, g in groups.items()}
    h, i = config.hidden_size, config.intermediate_size
    heads = (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
    assert paths == {
        f"rmsnorm+{heads}x{h}": ["cublas", "gemv", "gemv+norm", "gemv+rope", "gemv+norm+rope"],
        f"{h}x{config.num_attention_heads * config.head_dim}": ["cublas", "gemv"],  # o
        f"rmsnorm+{2 * i}x{h}+silu_mul": [  # gate_up
            "cublas",
            "gemv",
            "gemv+norm",
            "gemv+act",
            "gemv+norm+act",
        ],
        f"{h}x{i}": ["cublas", "gemv"],  # down
    }
    some = groups[f"rmsnorm+{2 * i}x{h}+silu_mul"]
    for path, flags in [
        ("gemv+norm+act", (True, True, True)),
        ("gemv+act", (True, False, True)),
        ("gemv+norm", (True, True, False)),
        ("gemv", (True, False, False)),
        ("cublas", (False, False, False)),
    ]:
        use_small_m_path(some, path)
        assert {(m.gemv, m.fuse_norm, m.fuse_act) for m in some} == {flags}


def test_qk_norm_in_the_qkv_epilogue_is_offered_for_power_of_two_heads_only():
    """A program of the QK-norm epilogue owns one head (a power-of-two tile): a qkv layer whose
    model norms q and k offers the rotary paths only for such head sizes; without QK-norm any
    even head size takes them."""
    from atom_runtime.layers.linear import QKVParallelLinear

    for head_dim, qk_norm, offered in [(128, True, True), (96, True, False), (96, False, True)]:
        layer = QKVParallelLinear(64, head_dim, 4, 2, bias=False)
        layer.norm_before = layer.rope_after = True
        layer.qk_norm_after = qk_norm
        paths = small_m_paths(layer)
        assert ("gemv+rope" in paths) == offered
        assert ("gemv+norm+rope" in paths) == offered

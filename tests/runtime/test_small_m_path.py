"""The one-row projection path the GPU takes at batch 1 when the GEMV wins (norm fused into
qkv/gate_up, SwiGLU fused into down) gives what the unfused path gives. On CPU the ops run
their torch references, so this checks the model's plumbing (the residual returned instead of
updated in place, the activation moved into the down projection); the Triton kernels behind
them are checked in tests/kernels/test_gemv.py."""

from __future__ import annotations

import pytest

from atom_runtime import LLM, SamplingParams
from atom_runtime.layers.linear import LinearBase, choose_small_m_kernels


@pytest.mark.parametrize("kind", ["qwen3", "qwen2"])
def test_fused_one_row_path_matches_the_unfused_one(tiny_models, kind):
    llm = LLM(str(tiny_models[kind]), dtype="float32", num_gpu_blocks_override=64)
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=0, ignore_eos=True)
    prompt = {"prompt_token_ids": [3, 14, 15, 92, 65, 35]}
    want = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, LinearBase)]
    assert {m.norm_before for m in layers} == {True, False}
    assert any(m.fused_act == "silu_mul" for m in layers)
    for m in layers:
        m.gemv = True
    try:
        got = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    finally:
        for m in layers:
            m.gemv = False
    assert got.token_ids == want.token_ids
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        assert all(abs(a[t] - b[t]) < 1e-4 for t in a)


def test_no_kernel_choice_off_the_gpu(tiny_models):
    llm = LLM(str(tiny_models["qwen3"]), dtype="float32", num_gpu_blocks_override=16)
    assert choose_small_m_kernels(llm.engine.runner.model, llm.engine.runner.device) == {}
    assert llm.engine.runner.small_m_kernels == {}

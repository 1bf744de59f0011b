"""The batch-1 paths of FP8 layers: groups of their own, every one-row path (the FP8 GEMV alone
or with the norm, SwiGLU or rotary + cache store fused in) giving what the plain FP8 GEMV gives,
and the timing's path functions taking each layer's scales. On CPU the ops run their torch
references (FP8 weights kept: `runs_natively` forced), so this checks the plumbing; the kernels
are checked in tests/kernels/test_fp8_*.py."""

from __future__ import annotations

import pytest
import torch

from atom_runtime import LLM, SamplingParams
from atom_runtime.layers import fp8_linear
from atom_runtime.layers.linear import LinearBase
from atom_runtime.worker.kernel_choice import _one_row_paths, small_m_groups, small_m_paths


@pytest.fixture
def fp8_llm(tiny_models, monkeypatch):
    monkeypatch.setattr(fp8_linear, "runs_natively", lambda device: True)
    return LLM(str(tiny_models["qwen3"]), dtype="float32", num_gpu_blocks_override=64,
               quantization="fp8")  # fmt: skip


def test_fp8_layers_form_groups_of_their_own_and_every_path_takes_their_scales(fp8_llm):
    model = fp8_llm.engine.executor.model
    groups = small_m_groups(model)
    assert groups and all(key.endswith("+fp8") for key in groups)
    for layers in groups.values():
        outs = {path: _one_path(layers, path) for path in small_m_paths(layers[0])}
        gemv = outs["gemv"]
        for path, y in outs.items():
            if path != "cublas" and "rope" not in path and "norm" not in path:
                assert torch.allclose(y, gemv, atol=1e-5), path


def _one_path(layers: list[LinearBase], path: str) -> torch.Tensor:
    # Fresh stand-in inputs for every path: the unfused add + RMSNorm before a projection adds
    # into its residual row in place, so paths sharing one set would each see another input.
    torch.manual_seed(0)
    return _one_row_paths(layers[0])[path](layers[-1])


def test_fp8_one_row_paths_give_the_plain_fp8_gemv_tokens(fp8_llm):
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=0, ignore_eos=True)
    prompt = {"prompt_token_ids": [3, 14, 15, 92, 65, 35]}
    layers = [m for m in fp8_llm.engine.executor.model.modules() if isinstance(m, LinearBase)]
    assert all(m.weight_scale is not None for m in layers)

    def run(fuse):
        for m in layers:
            m.gemv = True
            m.fuse_norm, m.fuse_act, m.fuse_rope = map(bool, fuse)
        try:
            return fp8_llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        finally:
            for m in layers:
                m.gemv = m.fuse_norm = m.fuse_act = m.fuse_rope = False

    want = run((0, 0, 0))
    for fuse in [(1, 0, 0), (0, 1, 0), (0, 0, 1), (1, 1, 1)]:
        got = run(fuse)
        assert got.token_ids == want.token_ids
        for a, b in zip(got.logprobs, want.logprobs, strict=True):
            assert all(abs(a[t] - b[t]) < 1e-4 for t in a)

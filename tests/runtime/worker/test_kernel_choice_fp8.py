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


@pytest.mark.parametrize("layout", ["channel", "block"])
def test_a_second_start_recalls_fp8_launch_shapes_per_fp8_kind(
    tiny_models, tmp_path, monkeypatch, layout
):
    """The compile cache keeps an FP8 group's path under its `+fp8` / `+fp8/block` name and its
    GEMV launch shape in a section of that kind (a bf16 shape of the same [n, k] launches other
    kernels); the second start times nothing and hands each recalled shape to the GEMV with the
    layer's FP8 kind."""
    from atom_runtime.models.loader import build_model
    from atom_runtime.models.source import load_model_config
    from atom_runtime.worker import kernel_choice
    from atom_runtime.worker.compile_cache import CompileCache
    from tests.fp8_checkpoints import write_fp8_checkpoint

    monkeypatch.setattr(fp8_linear, "runs_natively", lambda device: True)
    folder, _ = write_fp8_checkpoint(tiny_models["llama"], tmp_path, layout, block=16)
    model = build_model(folder, load_model_config(folder), "auto", torch.float32,
                        torch.device("cpu"))  # fmt: skip
    tag = "+fp8/block" if layout == "block" else "+fp8"
    groups = small_m_groups(model)
    assert groups and all(key.endswith(tag) for key in groups)
    launched: list[tuple] = []

    def set_shape(n, k, cfg, fp8=False, block_scaled=False):
        launched.append((n, k, cfg, fp8, block_scaled))

    monkeypatch.setattr("atom_kernels.gemv.set_launch_shape", set_shape)
    monkeypatch.setattr(kernel_choice, "_time_group", lambda key, layers, paths: paths[1])
    monkeypatch.setattr(kernel_choice, "tune_gemv_launch", lambda layers: {"block_n": 8})
    cuda = torch.device("cuda")  # a device name only: nothing runs on it
    first = kernel_choice.choose_small_m_kernels(model, cuda, CompileCache(tmp_path, {"gpu": "t"}))
    kept = CompileCache(tmp_path, {"gpu": "t"})
    section = f"auto{tag}"
    shapes = {tuple(layers[0].weight.shape) for layers in groups.values()}
    assert all(kept.launch_shape(section, n, k) == {"block_n": 8} for n, k in shapes)
    assert all(kept.launch_shape("auto", n, k) is None for n, k in shapes)

    def no_timing(*args, **kwargs):
        raise AssertionError("timed although the compile cache had the result")

    monkeypatch.setattr(kernel_choice, "_time_group", no_timing)
    monkeypatch.setattr(kernel_choice, "tune_gemv_launch", no_timing)
    second = kernel_choice.choose_small_m_kernels(model, cuda, CompileCache(tmp_path, {"gpu": "t"}))
    assert second == first
    assert {(n, k) for n, k, *_ in launched} == shapes
    assert all(cfg == {"block_n": 8} and fp8 and block == (layout == "block")
               for _, _, cfg, fp8, block in launched)  # fmt: skip

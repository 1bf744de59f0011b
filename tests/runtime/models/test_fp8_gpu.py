"""FP8 on the GPU (bf16 engine, CUDA graphs): FP8 checkpoints in 128 x 128 blocks and per
channel, `--quantization fp8` and `--kv-cache-dtype fp8`, teacher-forced against transformers in
fp32 on the dequantized weights (tests/runtime/models/test_fp8_accuracy.py says why
teacher-forced, and what the CPU versions check). Here the weights stay FP8 and the Triton /
`torch._scaled_mm` kernels run: the W8A8 GEMMs for many rows and the FP8 GEMV at batch 1 (forced
with ATOM_SMALL_M_KERNELS=gemv, so every one-row projection takes it, fused paths included).
bf16 activations add their own rounding, hence the looser bounds than the CPU's."""

from __future__ import annotations

import pytest
import torch

from atom_kernels.fp8_formats import is_fp8
from atom_runtime import LLM
from atom_runtime.layers.linear import LinearBase
from tests.fp8_checkpoints import teacher_forced, write_fp8_checkpoint, write_online_twin
from tests.hf_reference import random_prompts
from tests.model_factory import make_tiny_model

pytestmark = pytest.mark.gpu

PROMPTS = random_prompts(7, [9, 23, 40])
# Widths that sit on 128 x 128 scale blocks (q 256 rows, k and v 128 each, gate/up 512).
WIDE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
# The H200 measured mean_err 0.103 for the block-FP8 Llama at batch 1 (clear agreement 1.0).
BOUNDS = {"agreement": 0.6, "mean_err": 0.15}


@pytest.fixture(scope="module")
def wide_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_gpu")
    return {kind: make_tiny_model(root / kind, kind, **WIDE) for kind in ("llama", "qwen3")}


def _engine(folder, **kwargs) -> LLM:
    return LLM(str(folder), dtype="bfloat16", num_gpu_blocks_override=256, **kwargs)


def _check(llm: LLM, ref, prompts=PROMPTS) -> dict:
    result = teacher_forced(llm, ref, prompts, 8)
    assert result["agreement"] >= BOUNDS["agreement"], result
    assert result["clear_agreement"] == 1.0 and result["mean_err"] <= BOUNDS["mean_err"], result
    return result


@pytest.mark.parametrize("kind, layout", [("llama", "block"), ("qwen3", "channel")])
@pytest.mark.parametrize("one_row", ["auto", "gemv"])
def test_fp8_checkpoints_run_natively(wide_models, tmp_path, monkeypatch, kind, layout, one_row):
    monkeypatch.setenv("ATOM_SMALL_M_KERNELS", one_row)
    fp8_dir, twin = write_fp8_checkpoint(wide_models[kind], tmp_path, layout, block=128)
    llm = _engine(fp8_dir)
    model = llm.engine.executor.model
    fp8 = [m for m in model.modules() if isinstance(m, LinearBase) and is_fp8(m.weight)]
    assert len(fp8) == 8
    _check(llm, twin)
    # Batch 1: each prompt alone, so decode steps take the one-row paths.
    for prompt in PROMPTS:
        _check(llm, twin, [prompt])


def test_online_fp8_and_an_fp8_kv_cache(wide_models, tmp_path):
    twin = write_online_twin(wide_models["qwen3"], tmp_path / "twin")
    llm = _engine(wide_models["qwen3"], quantization="fp8", kv_cache_dtype="fp8")
    layers = llm.engine.executor.model.attention_layers()
    assert all(is_fp8(layer.k_cache) for layer in layers)
    _check(llm, twin)
    _check(llm, twin, PROMPTS[:1])


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_fp8_kv_cache_on_the_gpu(wide_models, kind):
    llm = _engine(wide_models[kind], kv_cache_dtype="fp8")
    executor = llm.engine.executor
    assert executor.kv_cache_dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
    _check(llm, wide_models[kind])

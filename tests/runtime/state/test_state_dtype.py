"""`--mamba-ssm-cache-dtype`: the recurrent state of hybrid models kept in 16 bits between steps
(issue 40), on tiny random hybrids, fp32 model on CPU.

Pinned: the flag's values and refusal; the slot tensors' dtypes and bytes, the checkpoint image
that follows them and its layout id; the memory plan fitting more slots in the same budget; a
request resumed from a checkpoint with a bf16 state bitwise equal to its recompute; and the
accuracy a 16-bit state costs, teacher-forced against transformers' fp32 reference and the fp32
state (benchmarks/state_dtype_accuracy.py; the figures are in docs/hybrid-models.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import random
from pathlib import Path

import pytest
import torch

from atom_runtime import LLM, SamplingParams
from atom_runtime.config import EngineConfig
from atom_runtime.engine_args import add_engine_arguments
from atom_runtime.state.slot_pool import ssm_state_dtype
from tests.model_factory import _HYBRID_COMMON

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parents[3]
C = _HYBRID_COMMON
LINEAR_LAYERS = 2  # linear, full, linear
CONV_DIM = 2 * C["linear_num_key_heads"] * 16 + C["linear_num_value_heads"] * 16
RECURRENT = C["linear_num_value_heads"] * 16 * 16  # values per layer and sequence


def _slot_bytes(recurrent_elem: int) -> int:
    """One slot of the tiny qwen3_5 in fp32: conv windows in fp32, the recurrent state in
    `recurrent_elem` bytes a value."""
    conv = CONV_DIM * (C["linear_conv_kernel_dim"] - 1) * 4
    return LINEAR_LAYERS * (conv + RECURRENT * recurrent_elem)


def test_the_flag_takes_vllms_values_and_refuses_others():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    for name in ("auto", "float32", "bfloat16", "float16"):
        args = parser.parse_args(["--mamba-ssm-cache-dtype", name])
        assert EngineConfig.from_args(args).mamba_ssm_cache_dtype == name
    assert EngineConfig().mamba_ssm_cache_dtype == "auto"
    assert [ssm_state_dtype(n) for n in ("auto", "float32", "bfloat16", "float16")] == [
        torch.float32, torch.float32, torch.bfloat16, torch.float16,
    ]  # fmt: skip
    with pytest.raises(ValueError, match="mamba_ssm_cache_dtype"):
        EngineConfig(mamba_ssm_cache_dtype="float8")
    with pytest.raises(SystemExit):
        parser.parse_args(["--mamba-ssm-cache-dtype", "int8"])


def test_slot_tensors_checkpoint_image_and_memory_plan_follow_the_dtype(
    tiny_hybrid_models, monkeypatch
):
    """With the same host budget (0.5 MiB, half of it for slots at most) a bf16 recurrent state
    gives smaller slots, so more of them; the conv windows stay in the model dtype; the
    checkpoint image is the slot, and its layout id tells the two layouts apart."""
    monkeypatch.setenv("ATOM_CPU_KVCACHE_SPACE", str(0.5 / 1024))
    engines = {}
    for name, elem in (("float32", 4), ("bfloat16", 2)):
        llm = LLM(
            str(tiny_hybrid_models["qwen3_5"]),
            dtype="float32",
            max_num_seqs=256,
            mamba_ssm_cache_dtype=name,
        )
        runner = llm.engine.executor
        state = runner.state
        for layer in state.layers:
            assert layer.conv_state.dtype == torch.float32
            assert layer.ssm_state.dtype == getattr(torch, name)
        assert runner.state_bytes_per_slot == _slot_bytes(elem)
        spec = runner.checkpoint_spec
        assert spec.image_bytes == spec.slot_bytes == _slot_bytes(elem)
        assert runner.num_state_slots == int(0.5 * 2**20 * 0.5) // _slot_bytes(elem)
        engines[name] = (runner.num_state_slots, spec.layout_id)
        llm.shutdown()
    assert engines["bfloat16"][0] > engines["float32"][0]
    assert engines["bfloat16"][1] != engines["float32"][1]


def _slot_state(llm: LLM, slot: int) -> list[torch.Tensor]:
    state = llm.engine.executor.state
    return [t[slot].clone() for layer in state.layers for t in (layer.conv_state, layer.ssm_state)]


def test_a_bf16_state_restored_from_a_checkpoint_is_bitwise_its_recompute(tiny_hybrid_models):
    """The prompt-end anchor of a first turn (32 tokens), restored for a follow-up, gives the
    slot a recompute with the same chunk splits ends with, byte for byte, in bf16."""
    folder = str(tiny_hybrid_models["qwen3_next"])
    rng = random.Random(3)
    prompt = [rng.randrange(3, 1000) for _ in range(47)]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    kw = dict(dtype="float32", num_gpu_blocks_override=64, mamba_ssm_cache_dtype="bfloat16")
    states = {}
    for name, extra in (
        ("resumed", {}),
        ("recompute", {"max_num_batched_tokens": 32, "state_checkpoint_interval_tokens": 0}),
    ):
        llm = LLM(folder, **kw, **extra)
        pool, seen = llm.engine.state_pool, {}
        allocate = pool.allocate

        def spy(seq, allocate=allocate, seen=seen):
            ok = allocate(seq)
            if ok:
                seen[seq.request_id] = seq.state_slots[0]
            return ok

        pool.allocate = spy
        if name == "resumed":
            llm.generate({"prompt_token_ids": prompt[:40]}, params, use_tqdm=False)
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        assert out.num_cached_tokens == (32 if name == "resumed" else 0)
        states[name] = _slot_state(llm, seen[out.request_id])
        llm.shutdown()
    for got, want in zip(states["resumed"], states["recompute"], strict=True):
        assert got.dtype in (torch.float32, torch.bfloat16)
        assert torch.equal(got, want)


@pytest.fixture(scope="module")
def accuracy():
    """benchmarks/state_dtype_accuracy.py, the measurement docs/hybrid-models.md quotes."""
    path = ROOT / "benchmarks" / "state_dtype_accuracy.py"
    spec = importlib.util.spec_from_file_location("state_dtype_accuracy", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_16bit_state_costs_little_accuracy_teacher_forced(tiny_hybrid_models, accuracy):
    """80 tokens teacher-forced one a step: the fp32 state is transformers' fp32 forward to
    float rounding; a bf16 state rounds (its error is well above that) yet keeps the next token
    nearly everywhere and the log-probs within 1e-2 on average; fp16 (3 more mantissa bits)
    errs less than bf16."""
    r = accuracy.measure(tiny_hybrid_models["qwen3_5"], 80, seed=1, model_dtype="float32",
                         vocab=49152)  # fmt: skip
    fp32 = r["float32"]["vs_transformers_fp32"]
    assert fp32["agreement"] == 1.0 and fp32["logprob_err_max"] < 1e-4
    bf16 = r["bfloat16"]["vs_engine_fp32_state"]
    assert bf16["agreement"] >= 0.95
    assert 20 * fp32["logprob_err_mean"] < bf16["logprob_err_mean"] < 1e-2
    fp16 = r["float16"]["vs_engine_fp32_state"]
    assert fp16["logprob_err_mean"] < bf16["logprob_err_mean"]
    assert r["bfloat16"]["vs_transformers_fp32"]["agreement"] >= 0.95

"""KV cache allocation: a GPU cache starts as zeros, so slots no step has written are finite.

A captured verify step reads slots past a sequence's real rows (weighted zero); an FP8 cache made
from the allocator's leftover bytes could hold NaN there (0x7f / 0xff), and zero times NaN is NaN
in the real rows' attention output."""

from __future__ import annotations

import pytest
import torch

from atom_runtime.layers.cache_spec import paged_kv_spec

FP8 = getattr(torch, "float8_e4m3fn", None)


@pytest.mark.skipif(FP8 is None, reason="this torch has no float8_e4m3fn")
@pytest.mark.parametrize("dtype", [torch.float32, FP8])
def test_a_zeroed_cache_holds_zeros_where_the_allocator_left_nan_bytes(dtype):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    spec = paged_kv_spec(num_kv_heads=2, head_dim=8, dtype=dtype)
    # Leave NaN bytes where the next allocation of the same size is likely to land.
    junk = torch.full((4 * 16 * 2 * 8 * 4,), 0xFF, dtype=torch.uint8, device=device)
    del junk
    k, v = spec.allocate(4, 16, torch.float32, device, zeroed=True)
    for t in (k, v):
        assert t.shape == (4, 16, 2, 8) and t.dtype == dtype
        assert not t.view(torch.uint8).any(), "a zeroed cache holds a non-zero byte"
        assert torch.isfinite(t.float()).all()


def test_an_unzeroed_cache_is_only_shaped():
    spec = paged_kv_spec(num_kv_heads=1, head_dim=4)
    (k, v) = spec.allocate(2, 8, torch.bfloat16, torch.device("cpu"))
    assert k.shape == v.shape == (2, 8, 1, 4) and k.dtype == torch.bfloat16


def test_shutdown_frees_the_kv_cache_and_state_slots(tmp_path, monkeypatch):
    """After `LLM.shutdown()` no live tensor shares memory with the KV cache or the state slots
    (the state-checkpoint copy plan holds byte views of both): a process that starts a second
    engine gets the memory back."""
    import gc

    from atom_runtime import LLM, SamplingParams
    from tests.model_factory import make_tiny_model

    monkeypatch.setenv("ATOM_CPU_KVCACHE_SPACE", "0.05")
    path = make_tiny_model(tmp_path / "qwen3_5", "qwen3_5")
    llm = LLM(str(path), dtype="float32", kv_cache_dtype="fp8", mamba_ssm_cache_dtype="bfloat16")
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2), use_tqdm=False)
    runner = llm.engine.executor
    assert runner._copy_plan is not None, "this model should have state checkpoints"
    held = {
        t.untyped_storage().data_ptr()
        for layer in runner.kv_layers()
        for t in layer.cache_tensors()
    }
    held |= {
        t.untyped_storage().data_ptr()
        for layer in runner.state.layers
        for t in (layer.conv_state, layer.ssm_state)
    }
    llm.shutdown()
    gc.collect()
    alive = [
        tuple(o.shape)
        for o in gc.get_objects()
        if isinstance(o, torch.Tensor) and o.numel() and o.untyped_storage().data_ptr() in held
    ]
    assert not alive, f"tensors still sharing the released caches' memory: {alive}"

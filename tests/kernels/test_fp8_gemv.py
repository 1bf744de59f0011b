"""The batch-1 GEMV family (`atom_kernels.gemv`) reading FP8 weights: per-tensor, per-channel and
128 x 128 block scales, x kept in its dtype (weight-only dequantization), against the torch
references (the dequantized weight, fp32 math), on shapes where N and K are not multiples of the
scale block and with the split-K, early-column, SwiGLU, fused-norm and rotary + cache-store
paths. An FP8 KV cache written by the rotary epilogue holds exactly the returned k and v
quantized with k_scale and v_scale.

CPU: the interpreter (fp32, fp16; its FP8 casts made exact by `exact_fp8_casts`). GPU: compiled,
bf16 too, plus serving shapes (`@pytest.mark.gpu`)."""

from __future__ import annotations

import pytest
import torch
from fp8_cases import LAYOUTS, quantized_weight

from atom_kernels import ops, reference
from atom_kernels.fp8_formats import fp8_dtype_for_platform

HAS_GPU = torch.cuda.is_available()
FP8 = fp8_dtype_for_platform()
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_GPU else [])
TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


@pytest.fixture
def gemv_mod(kernels, exact_fp8_casts):
    return kernels["gemv"]


def _row(k, dtype, device, seed=1):
    return torch.randn(1, k, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


def _bias(n, dtype, device):
    return torch.randn(n, generator=torch.Generator().manual_seed(2)).to(dtype).to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("split", "block_k"), [(1, None), (3, 32)])
@pytest.mark.parametrize("act", [None, "silu_mul"])
@pytest.mark.parametrize("early", [None, 1024])
def test_fp8_gemv_is_the_product_with_the_dequantized_weight(
    gemv_mod, device, dtype, layout, split, block_k, act, early
):
    """N = 300 (three block rows, the last ragged) or 2 x 192 SwiGLU rows, K = 700 (six block
    columns, the last ragged); split in three (steps of 32 inside each 128-column block) or
    not; the early columns one step or several blocks at once."""
    rows, k = (384, 700) if act else (300, 700)
    w, ws, block = quantized_weight(layout, rows, k, FP8, device)
    x, b = _row(k, dtype, device), _bias(rows, dtype, device)
    got = gemv_mod.gemv(
        x, w, b, act=act, split=split, block_k=block_k, early=early, weight_scale=ws,
        weight_block_size=block,
    )  # fmt: skip
    want = reference.linear_small_m(x, w, b, act=act, weight_scale=ws, weight_block_size=block)
    assert got.shape == want.shape and got.dtype == dtype
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("block_n", [16, 64])
@pytest.mark.parametrize("act", [None, "silu_mul"])
def test_fp8_gemv_other_row_blocks_keep_one_scale_block_a_run(gemv_mod, device, block_n, act):
    rows, k = (384, 300) if act else (300, 300)
    w, ws, block = quantized_weight("block", rows, k, FP8, device, seed=3)
    x = _row(k, torch.float32, device)
    got = gemv_mod.gemv(x, w, act=act, block_n=block_n, weight_scale=ws, weight_block_size=block)
    want = reference.linear_small_m(x, w, act=act, weight_scale=ws, weight_block_size=block)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_fp8_gemv_refuses_launches_that_straddle_scale_blocks(gemv_mod, device):
    w, ws, block = quantized_weight("block", 384, 300, FP8, device)
    x = _row(300, torch.float32, device)
    with pytest.raises(ValueError, match="block_k=256 must divide"):
        gemv_mod.gemv(x, w, block_k=256, weight_scale=ws, weight_block_size=block)
    with pytest.raises(ValueError, match="block_n=256 must divide"):
        gemv_mod.gemv(x, w, block_n=256, weight_scale=ws, weight_block_size=block)
    # SwiGLU over 2 x 200 rows: a 32-pair program's up rows start mid-way through a 32-row run
    w2, ws2, _ = quantized_weight("block", 400, 300, FP8, device)
    with pytest.raises(ValueError, match="the gate rows"):
        gemv_mod.gemv(x, w2, act="silu_mul", block_n=64, weight_scale=ws2, weight_block_size=block)
    # per-channel scales take any launch, 256-column steps included
    wc, wsc, _ = quantized_weight("channel", 384, 300, FP8, device)
    got = gemv_mod.gemv(x, wc, block_k=256, block_n=16, weight_scale=wsc)
    torch.testing.assert_close(got, reference.linear_small_m(x, wc, weight_scale=wsc))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["channel", "block"])
@pytest.mark.parametrize("with_residual", [False, True])
def test_fp8_gemv_with_the_rms_norm_in_front(gemv_mod, device, dtype, layout, with_residual):
    k = 300
    w, ws, block = quantized_weight(layout, 384, k, FP8, device, seed=4)
    x = _row(k, dtype, device, seed=5)
    residual = _row(k, dtype, device, seed=6) if with_residual else None
    norm_w = (torch.rand(k, generator=torch.Generator().manual_seed(7)) + 0.5).to(dtype)
    norm_w = norm_w.to(device)
    fp8 = dict(weight_scale=ws, weight_block_size=block)
    for act in (None, "silu_mul"):
        got, total = gemv_mod.rms_norm_linear_small_m(x, residual, norm_w, 1e-6, w, act=act, **fp8)
        want, want_total = reference.rms_norm_linear_small_m(
            x, residual, norm_w, 1e-6, w, act=act, **fp8
        )
        torch.testing.assert_close(got, want, **TOL[dtype])
        assert torch.equal(total, want_total)


def _rope_inputs(head_dim, dtype, cache_dtype, device):
    g = torch.Generator().manual_seed(13)
    angles = torch.rand(8, head_dim // 2, generator=g) * 6
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1).to(device)
    q_norm = (torch.rand(head_dim, generator=g) + 0.5).to(dtype).to(device)
    k_norm = (torch.rand(head_dim, generator=g) * 2).to(dtype).to(device)
    shape = (3, 4, 2, head_dim)
    k_cache = torch.randn(shape, generator=g).to(cache_dtype).to(device)
    v_cache = torch.randn(shape, generator=g).to(cache_dtype).to(device)
    return cos_sin, q_norm, k_norm, k_cache, v_cache


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 256])  # 256: a head's two halves in two scale blocks
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("fp8_cache", [False, True])
def test_fp8_gemv_rope_store_into_either_cache(
    gemv_mod, device, dtype, head_dim, qk_norm, fp8_cache
):
    """Block-scaled qkv weight; the cache in the activation dtype or FP8 (k_scale a tensor,
    v_scale a float). The returned row matches the reference; the FP8 cache holds exactly the
    returned k and v quantized (`reference.to_cache`), slot 6 only."""
    heads, kv_heads, k = 4, 2, 200
    n = (heads + 2 * kv_heads) * head_dim
    w, ws, block = quantized_weight("block", n, k, FP8, device, seed=14)
    x, b = _row(k, dtype, device, 15), _bias(n, dtype, device)
    cache_dtype = FP8 if fp8_cache else dtype
    cos_sin, q_norm, k_norm, k_cache, v_cache = _rope_inputs(head_dim, dtype, cache_dtype, device)
    norms = (q_norm, k_norm) if qk_norm else (None, None)
    k_scale, v_scale = torch.tensor([0.05], device=device), 0.11
    positions, slots = torch.tensor([5], device=device), torch.tensor([6], device=device)
    k_want, v_want = k_cache.clone(), v_cache.clone()
    common = (positions, cos_sin)
    heads_args = (heads, kv_heads, head_dim, *norms, 1e-6)
    fp8 = dict(weight_scale=ws, weight_block_size=block, k_scale=k_scale, v_scale=v_scale)
    got = gemv_mod.linear_rope_store_small_m(
        x, w, b, *common, k_cache, v_cache, slots, *heads_args, **fp8
    )
    want = reference.linear_rope_store_small_m(
        x, w, b, *common, k_want, v_want, slots, *heads_args, **fp8
    )
    torch.testing.assert_close(got, want, **TOL[dtype])
    k_row = got[0, heads * head_dim : (heads + kv_heads) * head_dim].view(kv_heads, head_dim)
    v_row = got[0, (heads + kv_heads) * head_dim :].view(kv_heads, head_dim)
    stored_k, stored_v = k_cache.view(-1, kv_heads, head_dim), v_cache.view(-1, kv_heads, head_dim)
    if fp8_cache:
        want_k = reference.to_cache(k_row, FP8, k_scale)
        want_v = reference.to_cache(v_row, FP8, v_scale)
        assert torch.equal(stored_k[6].view(torch.uint8), want_k.view(torch.uint8))
        assert torch.equal(stored_v[6].view(torch.uint8), want_v.view(torch.uint8))
    else:
        assert torch.equal(stored_k[6], k_row) and torch.equal(stored_v[6], v_row)
    others = [i for i in range(stored_k.shape[0]) if i != 6]
    assert torch.equal(
        stored_k[others].float(), k_want.view(-1, kv_heads, head_dim)[others].float()
    )


@pytest.mark.parametrize("layout", ["channel", "block"])
def test_fp8_gemv_norm_rope_store_matches_the_reference(gemv_mod, device, layout):
    """The decoder layer's input norm + FP8 qkv GEMV + QK-norm + rotary + FP8 cache store."""
    dtype, head_dim, heads, kv_heads, k = torch.float32, 128, 4, 2, 256
    n = (heads + 2 * kv_heads) * head_dim
    w, ws, block = quantized_weight(layout, n, k, FP8, device, seed=16)
    x, residual = _row(k, dtype, device, 17), _row(k, dtype, device, 18)
    norm_w = (torch.rand(k, generator=torch.Generator().manual_seed(19)) + 0.5).to(device)
    cos_sin, q_norm, k_norm, k_cache, v_cache = _rope_inputs(head_dim, dtype, FP8, device)
    k_want, v_want = k_cache.clone(), v_cache.clone()
    pos, slots = torch.tensor([2], device=device), torch.tensor([3], device=device)
    fp8 = dict(weight_scale=ws, weight_block_size=block, k_scale=0.07, v_scale=0.09)
    tail = (heads, kv_heads, head_dim, q_norm, k_norm, 1e-6)
    got, total = gemv_mod.rms_norm_linear_rope_store_small_m(
        x, residual, norm_w, 1e-6, w, None, pos, cos_sin, k_cache, v_cache, slots, *tail, **fp8
    )
    want, want_total = reference.rms_norm_linear_rope_store_small_m(
        x, residual, norm_w, 1e-6, w, None, pos, cos_sin, k_want, v_want, slots, *tail, **fp8
    )
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert torch.equal(total, want_total)
    k_row = got[0, heads * head_dim : (heads + kv_heads) * head_dim].view(kv_heads, head_dim)
    stored = k_cache.view(-1, kv_heads, head_dim)[3]
    assert torch.equal(
        stored.view(torch.uint8), reference.to_cache(k_row, FP8, 0.07).view(torch.uint8)
    )


def test_fp8_weight_arguments_are_checked():
    w, ws, block = quantized_weight("block", 300, 700, torch.float8_e4m3fn, "cpu")
    x = torch.randn(1, 700)
    with pytest.raises(ValueError, match="needs its weight_scale"):
        ops.linear_small_m(x, w)
    with pytest.raises(ValueError, match="go with an FP8 weight"):
        ops.linear_small_m(x, w.float(), weight_scale=ws, weight_block_size=block)
    with pytest.raises(ValueError, match="must be fp32"):
        ops.linear_small_m(x, w, weight_scale=ws.half(), weight_block_size=block)
    with pytest.raises(ValueError, match="fits no layout"):
        ops.linear_small_m(x, w, weight_scale=ws)  # block scales without the block size
    got = ops.linear_small_m(x, w, weight_scale=ws, weight_block_size=block)  # CPU: reference
    assert torch.equal(
        got, reference.linear_small_m(x, w, weight_scale=ws, weight_block_size=block)
    )


def test_fp8_launch_rule_and_candidates():
    from atom_kernels import gemv

    sms = 132
    rule = gemv.gemv_config(1024, 2048, sms, fp8=True)
    assert rule == gemv.fp8_rule_config(1024, 2048, sms)
    assert (rule["block_n"], rule["block_k"]) == (16, 256)
    assert rule["split"] == 2  # 64 row blocks: split in two, 1,024 columns each
    assert gemv.gemv_config(1024, 8192, sms, fp8=True)["split"] == 8
    # A block-scaled weight steps inside one 128-column scale block.
    assert gemv.gemv_config(1024, 2048, sms, fp8=True, block_scaled=True)["block_k"] == 128
    for block_scaled in (False, True):
        cands = gemv.fp8_launch_candidates(4096, 4096, sms, block_scaled)
        assert cands[0] == gemv.fp8_rule_config(4096, 4096, sms, block_scaled=block_scaled)
        assert len(cands) == len({tuple(sorted(c.items())) for c in cands}) > 1
        assert all(c["block_k"] <= 128 for c in cands) is block_scaled
    shape = gemv.fp8_launch_candidates(1024, 2048, sms, True)[-1]
    gemv.set_launch_shape(1024, 2048, shape, fp8=True, block_scaled=True)
    try:
        assert gemv.gemv_config(1024, 2048, sms, fp8=True, block_scaled=True) == shape
        assert gemv.gemv_config(1024, 2048, sms, fp8=True) == gemv.fp8_rule_config(1024, 2048, sms)
        assert gemv.gemv_config(1024, 2048, sms) == gemv.rule_config(1024, 2048, sms)
    finally:
        gemv.set_launch_shape(1024, 2048, None, fp8=True, block_scaled=True)


# -- GPU: bf16 at serving shapes ------------------------------------------------------------------

# Qwen3-0.6B's and Llama-3.1-8B's projections: (rows, K, act)
SERVING = [
    (4096, 1024, None),  # Qwen3-0.6B qkv
    (1024, 2048, None),  # o_proj
    (6144, 1024, "silu_mul"),  # gate_up
    (1024, 3072, None),  # down
    (6144, 4096, None),  # Llama-3.1-8B qkv
    (4096, 14336, None),  # down
]


@pytest.mark.gpu
@pytest.mark.parametrize(("rows", "k", "act"), SERVING)
@pytest.mark.parametrize("layout", ["channel", "block"])
def test_fp8_gemv_gpu_serving_shapes(kernels, rows, k, act, layout):
    gemv = kernels["gemv"]
    w, ws, block = quantized_weight(layout, rows, k, FP8, "cuda")
    x = _row(k, torch.bfloat16, "cuda")
    want = reference.linear_small_m(x, w, act=act, weight_scale=ws, weight_block_size=block)
    got = gemv.gemv(x, w, act=act, weight_scale=ws, weight_block_size=block)
    torch.testing.assert_close(got, want, **TOL[torch.bfloat16])
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for cfg in gemv.fp8_launch_candidates(rows, k, sms, layout == "block"):
        got = gemv.gemv(x, w, act=act, weight_scale=ws, weight_block_size=block, **cfg)
        torch.testing.assert_close(got, want, **TOL[torch.bfloat16])

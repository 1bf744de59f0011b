"""The fused hot-path kernels against the unfused reference path: QK-norm + rotary + cache store
in one pass, and SwiGLU's silu-and-mul.

On CPU they run under TRITON_INTERPRET=1 (fp32, fp16); on a GPU compiled (bf16 too). Unused cache
slots hold NaN so a stray write or a skipped padding row shows up."""

from __future__ import annotations

import pytest
import torch

from atom_kernels import ops, reference

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])
TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def _rope_cache(max_pos: int, dim: int) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_norm", [True, False])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(6, 2, 64), (5, 5, 32)])
def test_qk_norm_rope_store_matches_unfused_path(
    kernels, device, dtype, with_norm, num_heads, num_kv_heads, head_dim
):
    g = torch.Generator().manual_seed(7)
    tokens, block_size, num_blocks = 11, 8, 5
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(tokens, width, generator=g).to(dtype).to(device)
    positions = torch.tensor([0, 1, 2, 9, 17, 300, 511, 3, 3, 64, 40], device=device)
    slots = torch.tensor([0, 1, 2, 9, 17, -1, 31, 4, 5, 38, -1], device=device)
    cache = _rope_cache(512, head_dim).to(device)
    qw = kw = None
    if with_norm:
        qw = (torch.rand(head_dim, generator=g) + 0.5).to(dtype).to(device)
        kw = (torch.rand(head_dim, generator=g) + 0.5).to(dtype).to(device)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    want_qkv, want_k, want_v = qkv.clone(), k_cache.clone(), v_cache.clone()
    args = (1e-6,)
    reference.qk_norm_rope_store_(
        want_qkv,
        positions,
        cache,
        qw,
        kw,
        *args,
        want_k,
        want_v,
        slots,
        num_heads,
        num_kv_heads,
        head_dim,
    )
    kernels["fused"].qk_norm_rope_store_(
        qkv,
        positions,
        cache,
        qw,
        kw,
        *args,
        k_cache,
        v_cache,
        slots,
        num_heads,
        num_kv_heads,
        head_dim,
    )
    torch.testing.assert_close(qkv, want_qkv, **TOL[dtype])
    # Same slots written, the same values, and the -1 rows skipped (NaN stays NaN).
    torch.testing.assert_close(k_cache, want_k, equal_nan=True, **TOL[dtype])
    torch.testing.assert_close(v_cache, want_v, equal_nan=True, **TOL[dtype])
    assert torch.isnan(k_cache.view(-1, num_kv_heads, head_dim)[[6, 39]]).all()  # never written


def test_reference_fused_prep_equals_the_separate_ops():
    g = torch.Generator().manual_seed(3)
    t, h, kvh, d = 4, 4, 2, 32
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=g)
    pos = torch.tensor([1, 5, 9, 2])
    cache = _rope_cache(16, d)
    w1, w2 = torch.rand(d, generator=g), torch.rand(d, generator=g)
    kc = torch.zeros(2, 4, kvh, d)
    vc = torch.zeros(2, 4, kvh, d)
    slots = torch.tensor([0, 1, 2, 7])
    manual = qkv.clone()
    q = manual[:, : h * d].view(t, h, d)
    k = manual[:, h * d : (h + kvh) * d].view(t, kvh, d)
    v = manual[:, (h + kvh) * d :].view(t, kvh, d)
    q.copy_(reference.rms_norm(q, w1, 1e-6))
    k.copy_(reference.rms_norm(k, w2, 1e-6))
    reference.rotary_embedding_(pos, q, k, cache)
    fused = qkv.clone()
    ops.qk_norm_rope_store_(fused, pos, cache, w1, w2, 1e-6, kc, vc, slots, h, kvh, d)
    assert torch.equal(fused, manual)
    assert torch.equal(kc.view(-1, kvh, d)[7], k[3]) and torch.equal(vc.view(-1, kvh, d)[7], v[3])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "rotary_dim"),
    [(4, 2, 16, 4), (3, 1, 24, 8), (2, 2, 32, 32)],  # tiny Qwen3.5; rest not a power of 2; full
)
def test_gated_partial_rotary_prep_matches_reference(
    kernels, device, dtype, num_heads, num_kv_heads, head_dim, rotary_dim
):
    """Gated attention's layout ([query; gate] per q head) with partial rotary: queries and keys
    normed, their first rotary_dim channels rotated, the gates untouched, k/v cached."""
    g = torch.Generator().manual_seed(8)
    tokens, block_size, num_blocks = 9, 8, 4
    width = (2 * num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(tokens, width, generator=g).to(dtype).to(device)
    positions = torch.tensor([0, 1, 2, 9, 17, 300, 511, 3, 64], device=device)
    slots = torch.tensor([0, 1, 2, 9, 17, -1, 31, 4, 5], device=device)
    cache = _rope_cache(512, rotary_dim).to(device)
    qw = (torch.rand(head_dim, generator=g) + 0.5).to(dtype).to(device)
    kw = (torch.rand(head_dim, generator=g) + 0.5).to(dtype).to(device)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    want_qkv, want_k, want_v = qkv.clone(), k_cache.clone(), v_cache.clone()
    heads = (num_heads, num_kv_heads, head_dim)
    reference.qk_norm_rope_store_(
        want_qkv, positions, cache, qw, kw, 1e-6, want_k, want_v, slots, *heads, True
    )
    gates = qkv[:, : 2 * num_heads * head_dim].view(tokens, num_heads, 2, head_dim)[:, :, 1]
    gates_before = gates.clone()
    kernels["fused"].qk_norm_rope_store_(
        qkv, positions, cache, qw, kw, 1e-6, k_cache, v_cache, slots, *heads, True
    )
    torch.testing.assert_close(qkv, want_qkv, **TOL[dtype])
    assert torch.equal(gates, gates_before)
    torch.testing.assert_close(k_cache, want_k, equal_nan=True, **TOL[dtype])
    torch.testing.assert_close(v_cache, want_v, equal_nan=True, **TOL[dtype])
    assert torch.isnan(k_cache.view(-1, num_kv_heads, head_dim)[[6, 30]]).all()  # never written


def test_reference_gated_prep_equals_the_separate_ops():
    """What the gated attention layer ran before the fused prep: the queries cut out of
    [query; gate] and normed, keys normed, partial rotary, then the cache store."""
    g = torch.Generator().manual_seed(4)
    t, h, kvh, d, rot = 3, 2, 1, 16, 4
    qkv = torch.randn(t, (2 * h + 2 * kvh) * d, generator=g)
    pos = torch.tensor([3, 8, 2])
    cache = _rope_cache(16, rot)
    w1, w2 = torch.rand(d, generator=g), torch.rand(d, generator=g)
    kc, vc = torch.zeros(2, 4, kvh, d), torch.zeros(2, 4, kvh, d)
    slots = torch.tensor([0, 5, 7])
    q_gate = qkv[:, : 2 * h * d].view(t, h, 2 * d)
    q = reference.rms_norm(q_gate[..., :d].reshape(t * h, d), w1, 1e-6).view(t, h, d)
    k = reference.rms_norm(qkv[:, 2 * h * d : (2 * h + kvh) * d].reshape(t * kvh, d), w2, 1e-6)
    k = k.view(t, kvh, d)
    v = qkv[:, (2 * h + kvh) * d :].view(t, kvh, d)
    reference.rotary_embedding_(pos, q, k, cache)
    fused = qkv.clone()
    ops.qk_norm_rope_store_(fused, pos, cache, w1, w2, 1e-6, kc, vc, slots, h, kvh, d, True)
    fused_q_gate = fused[:, : 2 * h * d].view(t, h, 2 * d)
    assert torch.equal(fused_q_gate[..., :d], q)
    assert torch.equal(fused_q_gate[..., d:], q_gate[..., d:])
    assert torch.equal(kc.view(-1, kvh, d)[7], k[2]) and torch.equal(vc.view(-1, kvh, d)[5], v[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_sigmoid_gate_mul_matches_reference(kernels, device, dtype):
    """The gate read in place from [query; gate] heads (strided), x from attention."""
    g = torch.Generator().manual_seed(9)
    t, h, d = 5, 3, 40
    x = (torch.randn(t, h, d, generator=g) * 3).to(dtype).to(device)
    q_gate = (torch.randn(t, h, 2 * d, generator=g) * 4).to(dtype).to(device)
    gate = q_gate[..., d:]
    got = kernels["fused"].sigmoid_gate_mul(x, gate)
    want = reference.sigmoid_gate_mul(x, gate)
    assert got.shape == (t, h, d) and got.is_contiguous()
    torch.testing.assert_close(got, want, **TOL[dtype])
    torch.testing.assert_close(want.float(), x.float() * torch.sigmoid(gate.float()), **TOL[dtype])


def test_qk_norm_rope_store_refuses_mismatched_inputs():
    qkv = torch.zeros(2, 8 * 16)
    cache = _rope_cache(4, 16)
    kc = torch.zeros(1, 4, 2, 16)
    with pytest.raises(ValueError, match="together"):
        ops.qk_norm_rope_store_(
            qkv,
            torch.zeros(2, dtype=torch.long),
            cache,
            torch.ones(16),
            None,
            1e-6,
            kc,
            kc.clone(),
            torch.zeros(2, dtype=torch.long),
            4,
            2,
            16,
        )
    with pytest.raises(ValueError, match="must be"):
        ops.qk_norm_rope_store_(
            qkv,
            torch.zeros(2, dtype=torch.long),
            cache,
            None,
            None,
            1e-6,
            kc,
            kc.clone(),
            torch.zeros(2, dtype=torch.long),
            5,
            2,
            16,
        )
    no_gates = (kc, kc.clone(), torch.zeros(2, dtype=torch.long), 4, 2, 16)
    with pytest.raises(ValueError, match="must be"):  # [query; gate] heads need twice the q width
        ops.qk_norm_rope_store_(qkv, torch.zeros(2, dtype=torch.long), cache, None, None, 1e-6,
                                *no_gates, True)  # fmt: skip
    for rotary in (_rope_cache(4, 18), torch.zeros(4, 5)):  # wider than head_dim; odd
        with pytest.raises(ValueError, match="rotary dim"):
            ops.qk_norm_rope_store_(qkv, torch.zeros(2, dtype=torch.long), rotary, None, None,
                                    1e-6, *no_gates)  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [96, 1500])
def test_silu_and_mul_matches_reference(kernels, device, dtype, width):
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(7, 2 * width, generator=g) * 3).to(dtype).to(device)
    got = kernels["fused"].silu_and_mul(x)
    want = reference.silu_and_mul(x)
    assert got.shape == (7, width)
    torch.testing.assert_close(got, want, **TOL[dtype])
    gate, up = x.float().chunk(2, dim=-1)
    torch.testing.assert_close(want.float(), gate * torch.sigmoid(gate) * up, **TOL[dtype])

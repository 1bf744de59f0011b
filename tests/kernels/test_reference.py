"""Pins the torch references (the CPU path and the kernels' specification) against
independent naive implementations, and pins ops.py's dispatch rules."""

from __future__ import annotations

import pytest
import torch
from paged_cases import make_paged_case, naive_attention

from atom_kernels import ops, reference

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "block_size", "head_dim"),
    [(4, 4, 16, 64), (4, 2, 24, 32), (8, 2, 16, 96)],
)
def test_reference_decode_matches_naive(dtype, num_heads, num_kv_heads, block_size, head_dim):
    g = torch.Generator().manual_seed(0)
    seq_lens = [1, block_size, block_size + 1, 0, 3 * block_size - 5]
    case = make_paged_case(
        seq_lens,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        generator=g,
    )
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=g).to(dtype)
    scale = head_dim**-0.5
    out = reference.paged_attention_decode(
        q,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        torch.tensor(seq_lens, dtype=torch.int32),
        scale,
    )
    assert out.dtype == dtype and out.shape == q.shape
    for b, n in enumerate(seq_lens):
        want = naive_attention(q[b : b + 1], case, b, n - 1, scale)[0]
        torch.testing.assert_close(out[b].double(), want, **TOL[dtype])
    assert torch.equal(out[3], torch.zeros_like(out[3]))  # context_len 0 → zeros


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "block_size"), [(2, 2, 16), (4, 1, 24)])
def test_reference_prefill_matches_naive(dtype, num_heads, num_kv_heads, block_size):
    g = torch.Generator().manual_seed(1)
    head_dim = 32
    # (cached prefix, new chunk) per sequence: full prompt, chunk after a prefix that ends
    # mid-block, a single decode token, an empty chunk.
    shapes = [(0, 37), (block_size + 3, 11), (2 * block_size, 1), (5, 0)]
    seq_lens = [p + c for p, c in shapes]
    case = make_paged_case(
        seq_lens,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        generator=g,
    )
    q_lens = [c for _, c in shapes]
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(dtype)
    scale = 0.3
    out = reference.paged_attention_prefill(
        q,
        case.k_cache,
        case.v_cache,
        cu,
        torch.tensor(seq_lens, dtype=torch.int32),
        case.block_tables,
        scale,
        max(q_lens),
    )
    for b, (prefix, n) in enumerate(shapes):
        lo = int(cu[b])
        want = naive_attention(q[lo : lo + n], case, b, prefix, scale)
        torch.testing.assert_close(out[lo : lo + n].double(), want, **TOL[dtype])


def test_reference_prefill_chunks_long_prompts_in_query_slices(monkeypatch):
    """The query-chunking that bounds CPU memory must not change the result."""
    g = torch.Generator().manual_seed(2)
    case = make_paged_case(
        [50], num_kv_heads=1, head_dim=16, block_size=8, dtype=torch.float32, generator=g
    )
    q = torch.randn(50, 2, 16, generator=g)
    args = (q, case.k_cache, case.v_cache, torch.tensor([0, 50], dtype=torch.int32))
    rest = (torch.tensor([50], dtype=torch.int32), case.block_tables, 0.25, 50)
    whole = reference.paged_attention_prefill(*args, *rest)
    monkeypatch.setattr(reference, "_MAX_SCORE_ELEMENTS", 2 * 50 * 7)  # 7 query rows a slice
    sliced = reference.paged_attention_prefill(*args, *rest)
    torch.testing.assert_close(sliced, whole, atol=1e-6, rtol=1e-6)


def test_reference_store_kvcache_writes_slots_and_skips_padding():
    g = torch.Generator().manual_seed(3)
    k_cache = torch.zeros(4, 8, 2, 4)
    v_cache = torch.zeros(4, 8, 2, 4)
    key = torch.randn(3, 2, 4, generator=g)
    value = torch.randn(3, 2, 4, generator=g)
    reference.store_kvcache(key, value, k_cache, v_cache, torch.tensor([17, -1, 2]))
    assert torch.equal(k_cache[2, 1], key[0]) and torch.equal(v_cache[2, 1], value[0])
    assert torch.equal(k_cache[0, 2], key[2]) and torch.equal(v_cache[0, 2], value[2])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 2  # exactly two slots touched


def test_reference_rms_norm_matches_formula():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 48, generator=g).half()
    w = torch.randn(48, generator=g).half()
    want = x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    got = reference.rms_norm(x, w, 1e-6)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.double(), want, atol=2e-3, rtol=2e-3)


def test_reference_fused_add_rms_norm_updates_residual_in_place():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 40, generator=g)
    residual = torch.randn(3, 40, generator=g)
    w = torch.randn(40, generator=g)
    x_before, total = x.clone(), x + residual
    out, res = reference.fused_add_rms_norm(x, residual, w, 1e-5)
    assert res is residual and torch.equal(residual, total) and torch.equal(x, x_before)
    torch.testing.assert_close(out, reference.rms_norm(total, w, 1e-5), atol=0, rtol=0)


def rope_cache(max_pos: int, rotary_dim: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1).float()


def rope_by_complex(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, is_neox: bool):
    """Rotation as complex multiplication by e^{i·pos·freq}; float64."""
    half = rotary_dim // 2
    inv_freq = 10000.0 ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    phase = torch.polar(torch.ones(1, dtype=torch.float64), positions.double()[:, None] * inv_freq)
    x = x.double().clone()
    if is_neox:
        z = torch.complex(x[..., :half], x[..., half:rotary_dim]) * phase[:, None, :]
        x[..., :half], x[..., half:rotary_dim] = z.real, z.imag
    else:
        z = torch.complex(x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]) * phase[:, None, :]
        x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2] = z.real, z.imag
    return x


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [32, 16])
def test_reference_rotary_matches_complex_rotation_on_strided_views(is_neox, rotary_dim):
    g = torch.Generator().manual_seed(6)
    num_tokens, num_heads, num_kv_heads, head_dim = 7, 4, 2, 32
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(
        num_tokens, num_kv_heads, head_dim
    )
    v_before = qkv[:, (num_heads + num_kv_heads) * head_dim :].clone()
    positions = torch.tensor([0, 1, 5, 100, 2047, 3, 3])
    want_q = rope_by_complex(q, positions, rotary_dim, is_neox)
    want_k = rope_by_complex(k, positions, rotary_dim, is_neox)
    reference.rotary_embedding_(positions, q, k, rope_cache(2048, rotary_dim), is_neox)
    torch.testing.assert_close(q.double(), want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k.double(), want_k, atol=1e-5, rtol=1e-5)
    assert torch.equal(qkv[:, (num_heads + num_kv_heads) * head_dim :], v_before)


def test_ops_dispatch_cpu_tensors_to_torch_and_honours_forced_backend(monkeypatch):
    x = torch.zeros(1)
    monkeypatch.delenv(ops.BACKEND_ENV, raising=False)
    ops.refresh_backend()
    assert ops.backend_for(x) == "torch"
    monkeypatch.setenv(ops.BACKEND_ENV, "triton")
    ops.refresh_backend()
    assert ops.backend_for(x) == "triton"
    monkeypatch.setenv(ops.BACKEND_ENV, "cuda")
    with pytest.raises(ValueError, match="ATOM_KERNEL_BACKEND"):
        ops.refresh_backend()
    monkeypatch.delenv(ops.BACKEND_ENV)
    ops.refresh_backend()


def test_ops_torch_path_matches_reference():
    g = torch.Generator().manual_seed(7)
    case = make_paged_case(
        [9, 20], num_kv_heads=2, head_dim=16, block_size=8, dtype=torch.float32, generator=g
    )
    q = torch.randn(2, 4, 16, generator=g)
    lens = torch.tensor([9, 20], dtype=torch.int32)
    args = (q, case.k_cache, case.v_cache, case.block_tables, lens, 0.25)
    out = torch.empty_like(q)
    got = ops.paged_attention_decode(*args, out=out)
    assert got is out
    torch.testing.assert_close(got, reference.paged_attention_decode(*args), atol=0, rtol=0)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ops.paged_attention_decode(q[:, :3], *args[1:])

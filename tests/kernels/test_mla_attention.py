"""Multi-head latent attention kernels against their torch references, and the references
against an independent float64 computation of DeepSeek's attention with per-head K/V.

Pinned: the cache write (RMSNorm of the latent, rotary of the rope key in both pair layouts,
padding slots skipped, the query's rope channels rotated in place through a strided view); the
absorbed decode over a paged latent cache on awkward shapes (head counts across head blocks,
non-power-of-two latent and rope widths, pages of 16 and 24, empty rows, split-K counts); the
absorbed and the up-projected formulations giving the attention of the expanded per-head keys
and values. Without a GPU the Triton kernels run under TRITON_INTERPRET=1 in fp32 and fp16.
"""

from __future__ import annotations

import pytest
import torch
from paged_cases import make_paged_case

from atom_kernels import ops, reference

DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: dict(atol=3e-5, rtol=3e-5), torch.float16: dict(atol=3e-3, rtol=3e-3)}


def _cos_sin(max_pos: int, rope: int, theta: float = 10000.0) -> torch.Tensor:
    inv = 1.0 / theta ** (torch.arange(0, rope, 2, dtype=torch.float64) / rope)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).float()


def _latent_case(seq_lens, width, block_size, dtype, g):
    """A paged latent cache ([num_blocks, block_size, width], NaN where no sequence owns a
    slot) and its block tables (-1 past the used blocks)."""
    case = make_paged_case(
        seq_lens, num_kv_heads=1, head_dim=width, block_size=block_size, dtype=dtype, generator=g
    )
    return case.k_cache[:, :, 0].contiguous(), case.block_tables


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [False, True])
@pytest.mark.parametrize("block_size", [16, 24])
def test_rope_store_matches_reference_and_skips_padding(
    kernels, device, dtype, is_neox, block_size
):
    g = torch.Generator().manual_seed(1)
    tokens, heads, nope, latent, rope = 11, 5, 20, 40, 12
    q = torch.randn(tokens, heads, nope + rope, generator=g).to(dtype).to(device)
    # kv_a as the runtime passes it: a strided slice of a wider projection output.
    proj = torch.randn(tokens, 24 + latent + rope, generator=g).to(dtype).to(device)
    kv_a = proj[:, 24:]
    positions = torch.randint(0, 200, (tokens,), generator=g).to(device)
    cos_sin = _cos_sin(256, rope).to(device)
    norm_w = (1 + 0.1 * torch.randn(latent, generator=g)).to(dtype).to(device)
    num_blocks = 4
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    slots[[1, 6]] = -1
    slots = slots.to(device)
    cache = torch.randn(num_blocks, block_size, latent + rope, generator=g).to(dtype).to(device)
    want_q, want_cache = q.clone(), cache.clone()
    reference.mla_rope_store_(
        want_q[:, :, nope:], kv_a, positions, cos_sin, norm_w, 1e-6, want_cache, slots, is_neox
    )
    before = proj.clone()
    kernels["mla_attention"].mla_rope_store_(
        q[:, :, nope:], kv_a, positions, cos_sin, norm_w, 1e-6, cache, slots, is_neox
    )
    torch.testing.assert_close(q, want_q, **TOL[dtype])
    torch.testing.assert_close(cache, want_cache, **TOL[dtype])
    assert torch.equal(proj, before)  # kv_a is read, never written
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[slots >= 0].cpu()] = False
    flat, orig = cache.view(-1, latent + rope).cpu(), want_cache.view(-1, latent + rope).cpu()
    assert torch.equal(flat[untouched], orig[untouched])


def test_rope_store_reference_is_norm_then_rotary():
    """The stored row is RMSNorm(latent) * w beside the rope key rotated as `rotary_embedding_`
    rotates it; interleaved pairs by default (DeepSeek's layout)."""
    g = torch.Generator().manual_seed(2)
    latent, rope = 8, 4
    kv_a = torch.randn(3, latent + rope, generator=g, dtype=torch.float64)
    q_rope = torch.randn(3, 2, rope, generator=g, dtype=torch.float64)
    cos_sin = _cos_sin(16, rope).double()
    positions = torch.tensor([0, 5, 9])
    w = torch.randn(latent, generator=g, dtype=torch.float64)
    cache = torch.zeros(2, 4, latent + rope, dtype=torch.float64)
    slots = torch.tensor([7, -1, 2])
    q0 = q_rope.clone()
    reference.mla_rope_store_(q_rope, kv_a, positions, cos_sin, w, 1e-6, cache, slots)
    x = kv_a[:, :latent]
    normed = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w
    angle = positions[:, None].double() * (1e4 ** (-torch.arange(0, rope, 2) / rope))[None]
    pairs = kv_a[:, latent:].view(3, rope // 2, 2)
    rotated = torch.stack(
        [
            pairs[..., 0] * angle.cos() - pairs[..., 1] * angle.sin(),
            pairs[..., 1] * angle.cos() + pairs[..., 0] * angle.sin(),
        ],
        dim=-1,
    ).view(3, rope)
    flat = cache.view(-1, latent + rope)
    torch.testing.assert_close(flat[7], torch.cat([normed[0], rotated[0]]))
    torch.testing.assert_close(flat[2], torch.cat([normed[2], rotated[2]]))
    assert flat[[0, 1, 3, 4, 5, 6]].abs().sum() == 0  # padding token 1 stored nothing
    q_pairs = q0[1].view(2, rope // 2, 2)
    q_want = torch.stack(
        [
            q_pairs[..., 0] * angle[1].cos() - q_pairs[..., 1] * angle[1].sin(),
            q_pairs[..., 1] * angle[1].cos() + q_pairs[..., 0] * angle[1].sin(),
        ],
        dim=-1,
    ).view(2, rope)
    torch.testing.assert_close(q_rope[1], q_want)


def _decode_args(device, seed, seq_lens, heads, latent, rope, block_size, dtype):
    g = torch.Generator().manual_seed(seed)
    cache, tables = _latent_case(seq_lens, latent + rope, block_size, dtype, g)
    b = len(seq_lens)
    # q_latent as the runtime makes it: the [H, B, latent] bmm output seen as [B, H, latent].
    q_latent = torch.randn(heads, b, latent, generator=g).to(dtype).transpose(0, 1)
    q_rope = torch.randn(b, heads, 16 + rope, generator=g).to(dtype)[:, :, 16:]
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = (latent + rope) ** -0.5
    args = (q_latent, q_rope, cache, tables, lens)
    return tuple(t.to(device) for t in args) + (scale,)


DECODE_CASES = [
    # (heads, latent, rope, block_size, num_splits, block_n)
    pytest.param(5, 40, 12, 16, 1, 16, id="h5-l40-r12-bs16-nosplit"),
    pytest.param(20, 64, 8, 24, 3, 16, id="h20-l64-r8-bs24-split3"),
    pytest.param(3, 48, 16, 16, 4, 32, id="h3-l48-r16-bs16-split4"),
    pytest.param(16, 32, 8, 48, None, None, id="h16-l32-r8-bs48-auto"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("heads", "latent", "rope", "block_size", "splits", "block_n"), DECODE_CASES
)
def test_decode_matches_reference(
    kernels, device, dtype, heads, latent, rope, block_size, splits, block_n
):
    # One token, exactly one page, one past a page, empty (a padded graph row), several pages
    # ending mid-page.
    seq_lens = [1, block_size, block_size + 1, 0, 3 * block_size - 5]
    args = _decode_args(device, 3, seq_lens, heads, latent, rope, block_size, dtype)
    want = reference.mla_decode_attention(*args)
    got = kernels["mla_attention"].mla_decode_attention(*args, num_splits=splits, block_n=block_n)
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert torch.equal(got[3], torch.zeros_like(got[3]))


def test_decode_split_count_never_changes_the_result(kernels, device):
    """Splits past a row's end, uneven last splits and more live splits than the merge reads
    at a time (300 tokens in 16-token splits) all merge to the unsplit result."""
    args = _decode_args(device, 4, [97, 5, 0, 64, 300], 6, 24, 8, 16, torch.float32)
    want = reference.mla_decode_attention(*args)
    decode = kernels["mla_attention"].mla_decode_attention
    for splits in (1, 2, 7, 20):
        torch.testing.assert_close(
            decode(*args, num_splits=splits, block_n=16), want, **TOL[torch.float32]
        )


def _expanded_attention(q_nope, q_pe, latent_rows, w_kv, nope, scale):
    """DeepSeek's attention of one query token as transformers computes it, in float64: per-head
    keys [latent @ W_UK^T | rope key] and values latent @ W_UV^T, softmax over the context."""
    heads = q_nope.shape[0]
    lat = latent_rows.shape[1] - q_pe.shape[1]
    kv = (latent_rows[:, :lat] @ w_kv.T).view(-1, heads, w_kv.shape[0] // heads)
    k = torch.cat([kv[..., :nope], latent_rows[:, None, lat:].expand(-1, heads, -1)], dim=-1)
    v = kv[..., nope:]
    q = torch.cat([q_nope, q_pe], dim=-1)  # [H, nope + rope]
    probs = torch.softmax(torch.einsum("hd,nhd->hn", q, k) * scale, dim=-1)
    return torch.einsum("hn,nhv->hv", probs, v)


def test_absorbed_decode_is_the_expanded_attention():
    """q_nope absorbed through W_UK into the latent space, attention over the latent rows, the
    output through W_UV: the same as attending with per-head up-projected keys and values."""
    g = torch.Generator().manual_seed(5)
    heads, nope, v_dim, latent, rope, block_size = 3, 6, 5, 10, 4, 4
    seq_lens = [9, 1]
    cache, tables = _latent_case(seq_lens, latent + rope, block_size, torch.float64, g)
    w_kv = torch.randn(heads * (nope + v_dim), latent, generator=g, dtype=torch.float64)
    w = w_kv.view(heads, nope + v_dim, latent)
    q_nope = torch.randn(2, heads, nope, generator=g, dtype=torch.float64)
    q_pe = torch.randn(2, heads, rope, generator=g, dtype=torch.float64)
    scale = 0.3
    q_latent = torch.einsum("bhp,hpl->bhl", q_nope, w[:, :nope])
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    o_latent = reference.mla_decode_attention(q_latent, q_pe, cache, tables, lens, scale)
    got = torch.einsum("bhl,hvl->bhv", o_latent, w[:, nope:])
    for b, n in enumerate(seq_lens):
        rows = torch.stack([cache[tables[b, p // block_size], p % block_size] for p in range(n)])
        want = _expanded_attention(q_nope[b], q_pe[b], rows, w_kv, nope, scale)
        torch.testing.assert_close(got[b], want, atol=1e-5, rtol=1e-5)  # the reference's fp32


def test_prefill_reference_is_bottom_right_causal():
    """Chunk query i at position kv_len - q_len + i sees exactly keys 0..that position (a chunk
    over a cached prefix, a fresh chunk, a one-token chunk), with a narrower value dim."""
    g = torch.Generator().manual_seed(6)
    q_lens, kv_lens, heads, dk, dv = (3, 4, 1), (7, 4, 5), 2, 6, 4
    q = torch.randn(sum(q_lens), heads, dk, generator=g, dtype=torch.float64)
    k = torch.randn(sum(kv_lens), heads, dk, generator=g, dtype=torch.float64)
    v = torch.randn(sum(kv_lens), heads, dv, generator=g, dtype=torch.float64)
    got = reference.mla_prefill_attention(q, k, v, q_lens, kv_lens, 0.4)
    qa = ka = 0
    for ql, kl in zip(q_lens, kv_lens, strict=True):
        for i in range(ql):
            seen = kl - ql + i + 1
            s = torch.einsum("hd,nhd->hn", q[qa + i], k[ka : ka + seen]) * 0.4
            want = torch.einsum("hn,nhv->hv", torch.softmax(s, -1), v[ka : ka + seen])
            torch.testing.assert_close(got[qa + i], want, atol=1e-5, rtol=1e-5)
        qa, ka = qa + ql, ka + kl


def test_ops_refuse_mismatched_shapes():
    cache = torch.zeros(2, 4, 20)
    with pytest.raises(ValueError, match="q_latent"):
        ops.mla_decode_attention(
            torch.zeros(1, 2, 15), torch.zeros(1, 2, 4), cache, torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32), 1.0,
        )  # fmt: skip
    with pytest.raises(ValueError, match="more query tokens"):
        ops.mla_prefill_attention(
            torch.zeros(3, 1, 4), torch.zeros(2, 1, 4), torch.zeros(2, 1, 2), (3,), (2,), 1.0
        )


@pytest.mark.gpu
def test_prefill_sdpa_matches_reference_on_gpu(kernels):
    g = torch.Generator().manual_seed(7)
    q_lens, kv_lens, heads, dk, dv = (33, 128, 1), (200, 128, 17), 16, 192, 128
    for dtype, tol in ((torch.float32, 2e-4), (torch.bfloat16, 2e-2)):
        q = torch.randn(sum(q_lens), heads, dk, generator=g).to(dtype).cuda()
        k = torch.randn(sum(kv_lens), heads, dk, generator=g).to(dtype).cuda()
        v = torch.randn(sum(kv_lens), heads, dv, generator=g).to(dtype).cuda()
        want = reference.mla_prefill_attention(q, k, v, q_lens, kv_lens, dk**-0.5)
        got = kernels["mla_attention"].mla_prefill_attention(q, k, v, q_lens, kv_lens, dk**-0.5)
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.gpu
def test_decode_bf16_on_deepseek_v3_shapes(kernels):
    """The shapes DeepSeek-V3 runs (128 heads, latent 512, rope 64, pages of 16), bf16, split
    and unsplit, against the fp32 reference."""
    args = _decode_args("cuda", 8, [1, 700, 4096, 0, 33], 128, 512, 64, 16, torch.bfloat16)
    want = reference.mla_decode_attention(*args)
    decode = kernels["mla_attention"].mla_decode_attention
    for splits in (None, 1, 8):
        torch.testing.assert_close(decode(*args, num_splits=splits), want, atol=2e-2, rtol=2e-2)

"""The FP8 KV cache through every kernel that writes or reads it: `store_kvcache` and the fused
QK-norm + rotary + store (`qk_norm_rope_store_`) quantize k and v with per-tensor scales (a float
or a one-element tensor), and paged decode and prefill attention read the FP8 cache, folding
k_scale into the softmax scale and v_scale into the output. The references are pinned to an
independent float64 attention over the dequantized cache; a cache in the activation dtype is
untouched by the scales.

CPU: the interpreter with exact FP8 casts (`exact_fp8_casts`), e4m3fn and e4m3fnuz, q in fp32 and
fp16; unused cache slots hold NaN, so a read past a mask shows up. GPU: compiled, bf16 q, W1's
decode shape (`@pytest.mark.gpu`)."""

from __future__ import annotations

import pytest
import torch
from paged_cases import PagedCase, make_paged_case, naive_attention

from atom_kernels import ops, reference
from atom_kernels.fp8_formats import fp8_dtype_for_platform

HAS_GPU = torch.cuda.is_available()
FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz
FP8_DTYPES = [fp8_dtype_for_platform()] if HAS_GPU else [FN, FNUZ]
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_GPU else [])
TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=1.5e-2, rtol=1.5e-2),
}
K_SCALE, V_SCALE = 0.013, 0.0091  # randn / scale: most of the FP8 range, a few clamped


@pytest.fixture
def fp8k(kernels, exact_fp8_casts):
    return kernels


def _scales(kind: str, device):
    if kind == "tensor":
        return (torch.tensor([K_SCALE], device=device), torch.tensor([V_SCALE], device=device))
    return K_SCALE, V_SCALE


def _fp8_case(seq_lens, *, num_kv_heads, head_dim, block_size, fp8, device, seed) -> PagedCase:
    """A paged case (NaN in every slot no sequence owns) with its cache quantized to `fp8`."""
    case = make_paged_case(
        seq_lens, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
        dtype=torch.float32, generator=torch.Generator().manual_seed(seed),
    )  # fmt: skip
    case.k_cache = reference.to_cache(case.k_cache, fp8, K_SCALE).to(device)
    case.v_cache = reference.to_cache(case.v_cache, fp8, V_SCALE).to(device)
    case.block_tables = case.block_tables.to(device)
    return case


def _dequantized(case: PagedCase) -> PagedCase:
    return PagedCase(
        reference.from_cache(case.k_cache, K_SCALE).cpu(),
        reference.from_cache(case.v_cache, V_SCALE).cpu(),
        case.block_tables.cpu(),
        case.seq_lens,
    )


@pytest.mark.parametrize("fp8", FP8_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scales", ["float", "tensor"])
@pytest.mark.parametrize("block_size", [16, 24])
def test_store_quantizes_into_an_fp8_cache_and_skips_padding(
    fp8k, device, fp8, dtype, scales, block_size
):
    g = torch.Generator().manual_seed(1)
    num_tokens, kv_heads, head_dim = 13, 2, 96
    kv = (torch.randn(num_tokens, 2 * kv_heads * head_dim + 8, generator=g) * 2).to(dtype)
    kv[0, :4] = torch.tensor([1e4, -1e4, 0.0, -0.0])  # clamped to the format's range; zeros
    kv = kv.to(device)
    key = kv[:, : kv_heads * head_dim].view(num_tokens, kv_heads, head_dim)
    value = kv[:, kv_heads * head_dim : -8].view(num_tokens, kv_heads, head_dim)
    slots = torch.randperm(5 * block_size, generator=g)[:num_tokens]
    slots[[2, 7]] = -1
    slots = slots.to(device)
    shape = (5, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(fp8).to(device)
    v_cache = torch.randn(shape, generator=g).to(fp8).to(device)
    k_want, v_want = k_cache.clone(), v_cache.clone()
    k_scale, v_scale = _scales(scales, device)
    reference.store_kvcache(key, value, k_want, v_want, slots, k_scale=k_scale, v_scale=v_scale)
    fp8k["kv_cache"].store_kvcache(
        key, value, k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale
    )
    assert torch.equal(k_cache.view(torch.uint8), k_want.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v_want.view(torch.uint8))
    flat = k_want.view(-1, kv_heads, head_dim)[slots[0]].float()
    assert flat[0, 0] == torch.finfo(fp8).max and flat[0, 1] == -torch.finfo(fp8).max


def test_cache_round_trip_is_within_half_an_fp8_step():
    """The reference's own arithmetic: quantize with the scale, read back times the scale."""
    x = torch.randn(4000, generator=torch.Generator().manual_seed(2))
    for fp8 in (FN, FNUZ):
        back = reference.from_cache(reference.to_cache(x, fp8, 0.01), 0.01)
        inside = x.abs() < torch.finfo(fp8).max * 0.01
        err = (back - x).abs()[inside]
        assert (err <= x.abs()[inside] * 2**-4 + 0.01 * 2**-10).all()
        top = torch.tensor(torch.finfo(fp8).max) * torch.tensor(0.01)  # in fp32, as read back
        assert (back[~inside].abs() == top).all()  # clamped to the largest value, not NaN


def test_a_half_precision_cache_ignores_the_scales(kernels, device):
    g = torch.Generator().manual_seed(3)
    key = torch.randn(4, 2, 32, generator=g).half().to(device)
    k_cache = torch.zeros(2, 4, 2, 32, dtype=torch.float16, device=device)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([0, 3, -1, 5], device=device)
    kernels["kv_cache"].store_kvcache(key, key, k_cache, v_cache, slots, k_scale=0.5, v_scale=3.0)
    assert torch.equal(k_cache.view(-1, 2, 32)[slots[[0, 1, 3]]], key[[0, 1, 3]])
    assert torch.equal(v_cache, k_cache)


@pytest.mark.parametrize("fp8", FP8_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("rot", [32, 24])  # full and partial rotary
def test_fused_qk_norm_rope_store_into_an_fp8_cache(fp8k, device, fp8, dtype, qk_norm, rot):
    """The fused kernel leaves q and k rotated in qkv as the reference does, and its cache holds
    exactly those k (and the v) quantized: k rounded to the activation dtype first, as the
    unfused path stores what the rotary wrote."""
    g = torch.Generator().manual_seed(4)
    t, heads, kv_heads, head_dim = 5, 4, 2, 32
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype).to(device)
    angles = torch.rand(16, rot // 2, generator=g) * 6
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1).to(device)
    norm = (torch.rand(head_dim, generator=g) + 0.5).to(dtype).to(device) if qk_norm else None
    cache = torch.full((3, 4, kv_heads, head_dim), float("nan")).to(fp8).to(device)
    k_cache, v_cache = cache.clone(), cache.clone()
    k_want, v_want = cache.clone(), cache.clone()
    positions = torch.tensor([3, 0, 15, 7, 9], device=device)
    slots = torch.tensor([1, 4, -1, 11, 6], device=device)
    want = qkv.clone()
    args = (positions, cos_sin, norm, norm, 1e-6)
    tail = (slots, heads, kv_heads, head_dim)
    scales = dict(k_scale=torch.tensor([0.02], device=device), v_scale=0.03)
    reference.qk_norm_rope_store_(want, *args, k_want, v_want, *tail, **scales)
    fp8k["fused"].qk_norm_rope_store_(qkv, *args, k_cache, v_cache, *tail, **scales)
    torch.testing.assert_close(qkv, want, **TOL[dtype])
    k_rows = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(t, kv_heads, head_dim)
    v_rows = qkv[:, (heads + kv_heads) * head_dim :].view(t, kv_heads, head_dim)
    live = slots >= 0
    stored_k = k_cache.view(-1, kv_heads, head_dim)[slots[live]]
    stored_v = v_cache.view(-1, kv_heads, head_dim)[slots[live]]
    assert torch.equal(
        stored_k.view(torch.uint8), reference.to_cache(k_rows[live], fp8, 0.02).view(torch.uint8)
    )
    assert torch.equal(
        stored_v.view(torch.uint8), reference.to_cache(v_rows[live], fp8, 0.03).view(torch.uint8)
    )
    untouched = torch.ones(12, dtype=torch.bool)
    untouched[slots[live].cpu()] = False
    assert k_cache.view(-1, kv_heads, head_dim)[untouched.to(device)].float().isnan().all()


DECODE = [
    # (num_heads, num_kv_heads, block_size, head_dim, num_splits, heads_per_program)
    pytest.param(4, 4, 16, 64, 1, 1, id="mha-nosplit"),
    pytest.param(4, 2, 24, 64, 3, 1, id="gqa2-bs24-split3"),
    pytest.param(8, 4, 16, 32, 1, 2, id="gqa2-two-heads-a-program"),
    pytest.param(6, 2, 16, 96, 2, 1, id="gqa3-d96-split2"),
]


@pytest.mark.parametrize("fp8", FP8_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scales", ["float", "tensor"])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "block_size", "head_dim", "splits", "hpp"),
                         DECODE)  # fmt: skip
def test_decode_reads_an_fp8_cache(
    fp8k, device, fp8, dtype, scales, num_heads, num_kv_heads, block_size, head_dim, splits, hpp
):
    seq_lens = [1, block_size, block_size + 1, 0, 3 * block_size - 5]
    case = _fp8_case(
        seq_lens, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size, fp8=fp8,
        device=device, seed=5,
    )  # fmt: skip
    g = torch.Generator().manual_seed(6)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=g).to(dtype).to(device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    k_scale, v_scale = _scales(scales, device)
    args = (q, case.k_cache, case.v_cache, case.block_tables, lens, head_dim**-0.5)
    want = reference.paged_attention_decode(*args, k_scale=k_scale, v_scale=v_scale)
    got = fp8k["decode_attention"].paged_attention_decode(
        *args, k_scale=k_scale, v_scale=v_scale, num_splits=splits, block_n=16,
        heads_per_program=hpp,
    )  # fmt: skip
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert torch.equal(got[3], torch.zeros_like(got[3]))
    # the reference is attention over the dequantized cache
    plain = _dequantized(case)
    for b, n in enumerate(seq_lens):
        if n:
            exact = naive_attention(q[b : b + 1].cpu(), plain, b, n - 1, head_dim**-0.5)
            torch.testing.assert_close(want[b].cpu().double(), exact[0], **TOL[dtype])


PREFILL = [
    # (num_heads, num_kv_heads, head_dim, block_size, launch overrides)
    pytest.param(4, 2, 64, 16, dict(block_m=32, block_n=16, heads_per_program=2,
                                    kv_lookup="page", num_splits=3), id="gqa2-page-split3"),
    pytest.param(4, 2, 64, 16, dict(block_m=16, block_n=16, kv_lookup="row"), id="gqa2-row"),
    pytest.param(2, 2, 32, 32, dict(block_m=16, block_n=16, kv_lookup="tile", num_splits=2),
                 id="mha-tile-split2"),
]  # fmt: skip


@pytest.mark.parametrize("fp8", FP8_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size", "launch"),
                         PREFILL)  # fmt: skip
def test_prefill_reads_an_fp8_cache(
    fp8k, device, fp8, dtype, num_heads, num_kv_heads, head_dim, block_size, launch
):
    # (cached prefix, chunk): a prefix ending mid-page under a ragged chunk, a whole prompt, a
    # decode row, an empty chunk.
    shapes = [(70, 19), (0, 23), (1, 1), (30, 0)]
    seq_lens = [p + c for p, c in shapes]
    q_lens = [c for _, c in shapes]
    case = _fp8_case(
        seq_lens, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size, fp8=fp8,
        device=device, seed=7,
    )  # fmt: skip
    g = torch.Generator().manual_seed(8)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(dtype).to(device)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    args = (
        q, case.k_cache, case.v_cache, cu.to(device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device), case.block_tables,
        head_dim**-0.5, max(q_lens),
    )  # fmt: skip
    k_scale, v_scale = _scales("tensor", device)
    want = reference.paged_attention_prefill(*args, k_scale=k_scale, v_scale=v_scale)
    got = fp8k["prefill_attention"].paged_attention_prefill(
        *args, k_scale=k_scale, v_scale=v_scale, **launch
    )
    torch.testing.assert_close(got, want, **TOL[dtype])
    plain = _dequantized(case)
    exact = naive_attention(q[:19].cpu(), plain, 0, 70, head_dim**-0.5)
    torch.testing.assert_close(want[:19].cpu().double(), exact, **TOL[dtype])


def test_prefill_warm_up_of_an_fp8_cache_needs_the_model_dtype(fp8k, device):
    prefill = fp8k["prefill_attention"]
    case = _fp8_case([5], num_kv_heads=2, head_dim=32, block_size=16, fp8=FP8_DTYPES[0],
                     device=device, seed=9)  # fmt: skip
    before = case.k_cache.clone()
    launch = prefill.plan_prefill_launch(
        num_heads=4, num_kv_heads=2, head_dim=32, page_size=16, batch=1, max_seqlen_q=1,
        max_context=16, num_multiprocessors=4, block_m=16, block_n=16,
    )  # fmt: skip
    with pytest.raises(ValueError, match="q_dtype"):
        prefill.warm_up(case.k_cache, case.v_cache, 4, 256, 0.1, [launch])
    scales = _scales("tensor", device)
    failed = prefill.warm_up(
        case.k_cache, case.v_cache, 4, 256, 0.1, [launch], q_dtype=DTYPES[0], k_scale=scales[0],
        v_scale=scales[1],
    )  # fmt: skip
    assert failed == []
    assert torch.equal(case.k_cache.view(torch.uint8), before.view(torch.uint8))


def test_cache_scales_are_checked():
    cache = torch.zeros(2, 4, 2, 32, dtype=FN)
    q = torch.zeros(1, 4, 32)
    tables = torch.zeros(1, 1, dtype=torch.int32)
    lens = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="k_scale must be a float or a one-element fp32"):
        ops.paged_attention_decode(q, cache, cache, tables, lens, 0.1, k_scale=torch.ones(2))
    with pytest.raises(ValueError, match="v_scale"):
        ops.paged_attention_decode(q, cache, cache, tables, lens, 0.1, v_scale=torch.ones(1).half())
    with pytest.raises(ValueError, match="one cache dtype"):
        ops.paged_attention_decode(q, cache, cache.half(), tables, lens, 0.1)
    with pytest.raises(ValueError, match="only the cache may be FP8"):
        ops.paged_attention_decode(q.to(FN), cache, cache, tables, lens, 0.1)


# -- GPU ------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_decode_fp8_cache_at_the_w1_shape(kernels):
    """W1's decode (batch 256, 16 q / 8 KV heads, head_dim 128, contexts up to 1,536) over an
    FP8 cache: against the reference, and within FP8 noise of the same attention over the
    unquantized bf16 cache (tensor scales, as a captured graph passes them)."""
    fp8 = fp8_dtype_for_platform()
    g = torch.Generator().manual_seed(10)
    seq_lens = torch.randint(100, 1537, (256,), generator=g).tolist()
    seq_lens[9] = 0
    case = make_paged_case(
        seq_lens, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.float32, generator=g
    )
    q = torch.randn(256, 16, 128, generator=g).bfloat16().cuda()
    lens = torch.tensor(seq_lens, dtype=torch.int32).cuda()
    tables = case.block_tables.cuda()
    k_scale, v_scale = torch.tensor([K_SCALE]).cuda(), torch.tensor([V_SCALE]).cuda()
    k8 = reference.to_cache(case.k_cache, fp8, K_SCALE).cuda()
    v8 = reference.to_cache(case.v_cache, fp8, V_SCALE).cuda()
    args = (q, k8, v8, tables, lens, 128**-0.5)
    want = reference.paged_attention_decode(*args, k_scale=k_scale, v_scale=v_scale)
    got = kernels["decode_attention"].paged_attention_decode(
        *args, k_scale=k_scale, v_scale=v_scale
    )
    torch.testing.assert_close(got, want, **TOL[torch.bfloat16])
    assert torch.equal(got[9], torch.zeros_like(got[9]))
    bf16 = (case.k_cache.bfloat16().cuda(), case.v_cache.bfloat16().cuda())
    full = kernels["decode_attention"].paged_attention_decode(q, *bf16, tables, lens, 128**-0.5)
    live = [b for b, n in enumerate(seq_lens) if n]
    err = (got[live].float() - full[live].float()).norm() / full[live].float().norm()
    assert err < 0.05


@pytest.mark.gpu
def test_prefill_fp8_cache_bf16(kernels):
    fp8 = fp8_dtype_for_platform()
    shapes = [(1000, 300), (0, 700), (50, 1)]
    seq_lens = [p + c for p, c in shapes]
    q_lens = [c for _, c in shapes]
    g = torch.Generator().manual_seed(11)
    case = make_paged_case(
        seq_lens, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.float32, generator=g
    )
    q = torch.randn(sum(q_lens), 32, 128, generator=g).bfloat16().cuda()
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32).cuda()
    k_scale, v_scale = torch.tensor([K_SCALE]).cuda(), torch.tensor([V_SCALE]).cuda()
    args = (
        q, reference.to_cache(case.k_cache, fp8, K_SCALE).cuda(),
        reference.to_cache(case.v_cache, fp8, V_SCALE).cuda(), cu,
        torch.tensor(seq_lens, dtype=torch.int32).cuda(), case.block_tables.cuda(), 128**-0.5,
        max(q_lens),
    )  # fmt: skip
    want = reference.paged_attention_prefill(*args, k_scale=k_scale, v_scale=v_scale)
    for splits in (None, 1, 4):
        got = kernels["prefill_attention"].paged_attention_prefill(
            *args, k_scale=k_scale, v_scale=v_scale, num_splits=splits
        )
        torch.testing.assert_close(got, want, **TOL[torch.bfloat16])

"""Each Triton kernel against its torch reference on awkward shapes.

Without a GPU these run under TRITON_INTERPRET=1 on CPU tensors (see conftest.py) in fp32
and fp16; on a GPU the same tests run the compiled kernels. Unused cache slots hold NaN
(see paged_cases.py), so any read past a mask shows up as a NaN mismatch.
"""

from __future__ import annotations

import pytest
import torch
from paged_cases import make_paged_case

from atom_kernels import ops, reference

DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=3e-3, rtol=3e-3)}


def _cu_seqlens(q_lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)


def _to(case, device):
    case.k_cache = case.k_cache.to(device)
    case.v_cache = case.v_cache.to(device)
    case.block_tables = case.block_tables.to(device)
    return case


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 24])
def test_store_kvcache_matches_reference_and_skips_padding(kernels, device, dtype, block_size):
    g = torch.Generator().manual_seed(10)
    num_tokens, num_kv_heads, head_dim = 13, 2, 96
    # key/value as strided views of a fused projection output, as the runtime passes them.
    kv = torch.randn(num_tokens, 2 * num_kv_heads * head_dim + 8, generator=g).to(dtype)
    kv = kv.to(device)
    key = kv[:, : num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = kv[:, num_kv_heads * head_dim : -8].view(num_tokens, num_kv_heads, head_dim)
    num_blocks = 5
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[[2, 7]] = -1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype).to(device)
    v_cache = torch.randn(shape, generator=g).to(dtype).to(device)
    k_want, v_want = k_cache.clone(), v_cache.clone()
    slots = slots.to(device)
    reference.store_kvcache(key, value, k_want, v_want, slots)
    kernels["kv_cache"].store_kvcache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want)


DECODE_CASES = [
    # (num_heads, num_kv_heads, block_size, head_dim, num_splits, block_n)
    pytest.param(4, 4, 16, 64, 1, 16, id="mha-bs16-d64-nosplit"),
    pytest.param(4, 2, 24, 64, 3, 16, id="gqa2-bs24-d64-split3"),
    pytest.param(8, 2, 16, 128, 4, 32, id="gqa4-bs16-d128-split4"),
    pytest.param(6, 2, 48, 96, 2, 32, id="gqa3-bs48-d96-split2"),
    pytest.param(4, 1, 128, 64, None, None, id="gqa4-bs128-d64-auto"),
]


def _decode_args(
    device, seed, seq_lens, num_heads, num_kv_heads, block_size, scale, head_dim=32,
    dtype=torch.float32,
):  # fmt: skip
    """paged_attention_decode's positional arguments for a paged case of `seq_lens` (the cache
    drawn first, then q, from one generator seeded `seed`)."""
    g = torch.Generator().manual_seed(seed)
    case = _to(
        make_paged_case(
            seq_lens, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
            dtype=dtype, generator=g,
        ),
        device,
    )  # fmt: skip
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=g).to(dtype).to(device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return q, case.k_cache, case.v_cache, case.block_tables, lens, scale


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "block_size", "head_dim", "num_splits", "block_n"), DECODE_CASES
)
def test_decode_matches_reference(
    kernels, device, dtype, num_heads, num_kv_heads, block_size, head_dim, num_splits, block_n
):
    # Lengths: one token, exactly one block, one past a block, empty (padded graph row),
    # several blocks ending mid-block.
    seq_lens = [1, block_size, block_size + 1, 0, 3 * block_size - 5]
    args = _decode_args(
        device, 11, seq_lens, num_heads, num_kv_heads, block_size, head_dim**-0.5, head_dim, dtype
    )
    want = reference.paged_attention_decode(*args)
    got = kernels["decode_attention"].paged_attention_decode(
        *args, num_splits=num_splits, block_n=block_n
    )
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert torch.equal(got[3], torch.zeros_like(got[3]))


def test_decode_split_count_never_changes_the_result(kernels, device):
    """Splits that start past a sequence's end and uneven last splits merge correctly, and so
    do more live splits than the merge reads at a time (300 tokens in 16-token splits: 19)."""
    args = _decode_args(device, 12, [97, 5, 0, 64, 300], 4, 2, 8, 0.17)
    want = reference.paged_attention_decode(*args)
    decode = kernels["decode_attention"].paged_attention_decode
    for splits in (1, 2, 5, 7, 12, 20):
        torch.testing.assert_close(
            decode(*args, num_splits=splits, block_n=16), want, **TOL[args[0].dtype]
        )


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_grid_order_never_changes_the_result(kernels, device, splits):
    """The grid with a sequence's KV heads fastest (`heads_fastest=True`) gives the output of the
    default order, split or not (GQA group 2, an empty row, lengths across pages)."""
    args = _decode_args(device, 13, [33, 0, 70, 16], 6, 3, 16, 0.2)
    decode = kernels["decode_attention"].paged_attention_decode
    want = reference.paged_attention_decode(*args)
    by_seq = decode(*args, num_splits=splits, block_n=16, heads_fastest=False)
    by_head = decode(*args, num_splits=splits, block_n=16, heads_fastest=True)
    torch.testing.assert_close(by_head, want, **TOL[args[0].dtype])
    torch.testing.assert_close(by_head, by_seq, atol=0, rtol=0)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "heads", "splits"),
                         [(6, 6, 2, 1), (8, 4, 2, 1), (8, 4, 2, 3), (8, 2, 2, 1), (32, 8, 4, 1)])  # fmt: skip
def test_decode_heads_per_program_never_changes_the_result(
    kernels, device, num_heads, num_kv_heads, heads, splits
):
    """Several KV heads a program (a block-diagonal query tile over their side-by-side columns)
    give the one-head-a-program output: MHA, GQA 2 and 4, split or not, both grid orders, an
    empty row and lengths across pages."""
    args = _decode_args(device, 14, [33, 0, 70, 16, 1], num_heads, num_kv_heads, 16, 0.2)
    decode = kernels["decode_attention"].paged_attention_decode
    want = reference.paged_attention_decode(*args)
    one = decode(*args, num_splits=splits, block_n=16, heads_per_program=1)
    for heads_fastest in (False, True):
        packed = decode(
            *args, num_splits=splits, block_n=16, heads_per_program=heads,
            heads_fastest=heads_fastest,
        )  # fmt: skip
        torch.testing.assert_close(packed, want, **TOL[args[0].dtype])
        torch.testing.assert_close(packed, one, atol=1e-6, rtol=1e-5)
    assert torch.equal(packed[1], torch.zeros_like(packed[1]))


def test_decode_heads_per_program_is_refused_when_it_does_not_fit(kernels, device):
    args = _decode_args(device, 15, [5, 9], 8, 4, 16, 0.2)
    decode = kernels["decode_attention"].paged_attention_decode
    with pytest.raises(ValueError, match="heads_per_program 3: must divide 4 KV heads"):
        decode(*args, heads_per_program=3)
    args = _decode_args(device, 15, [5, 9], 36, 4, 16, 0.2)  # group 9: two groups need 18 rows
    with pytest.raises(ValueError, match="fit its 18 query heads in 16 rows"):
        decode(*args, heads_per_program=2)


def test_decode_heads_per_program_choice():
    """Two heads a program only where an unsplit launch keeps >= 4 programs per multiprocessor
    with them, the query groups fit 16 rows and head_dim <= 128."""
    from atom_kernels import decode_attention as d

    choose = d.decode_heads_per_program
    assert choose(256, 8, 2, 128, 1, 132) == (2 if d.PACK_HEADS else 1)  # W1: 1,024 programs
    assert choose(64, 8, 2, 128, 1, 132) == 1  # 256 programs: too few
    assert choose(256, 8, 2, 128, 2, 132) == 1  # split
    assert choose(256, 8, 2, 256, 1, 132) == 1  # head_dim 256
    assert choose(256, 8, 16, 128, 1, 132) == 1  # two groups of 16 need 32 rows
    assert choose(256, 7, 2, 128, 1, 132) == 1  # odd KV heads


def test_decode_writes_into_out_and_ignores_block_table_padding(kernels, device):
    g = torch.Generator().manual_seed(13)
    seq_lens = [20, 3]
    cases = [
        make_paged_case(
            seq_lens,
            num_kv_heads=1,
            head_dim=32,
            block_size=16,
            dtype=torch.float32,
            generator=torch.Generator().manual_seed(13),
            pad_value=pad,
        )
        for pad in (-1, 0)
    ]
    q = torch.randn(2, 2, 32, generator=g).to(device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    results = []
    for case in cases:
        _to(case, device)
        out = torch.full_like(q, 7.0)
        got = kernels["decode_attention"].paged_attention_decode(
            q, case.k_cache, case.v_cache, case.block_tables, lens, 0.2, out, num_splits=2
        )
        assert got is out
        results.append(out)
    torch.testing.assert_close(results[0], results[1], atol=0, rtol=0)


def test_choose_num_splits_depends_on_shapes_only(kernels):
    choose = kernels["decode_attention"].choose_num_splits
    h200 = 132  # multiprocessors
    assert choose(1, 8, 32768, 64, h200) == 32  # one long sequence: split to the cap
    assert choose(4, 8, 4096, 64, h200) == 9  # ~2 programs per multiprocessor
    assert choose(4, 8, 512, 64, h200) == 2  # but no split shorter than 256 tokens
    assert choose(1, 8, 64, 64, h200) == 1  # too short to be worth a merge
    assert choose(64, 8, 32768, 64, h200) == 1  # the batch alone fills the device


PREFILL_CASES = [
    # (num_heads, num_kv_heads, block_size, head_dim, block_m, block_n)
    pytest.param(4, 4, 16, 64, 16, 16, id="mha-bs16-d64"),
    pytest.param(4, 2, 24, 64, 32, 16, id="gqa2-bs24-d64"),
    pytest.param(8, 2, 16, 128, 16, 32, id="gqa4-bs16-d128"),
    pytest.param(6, 2, 48, 96, 16, 16, id="gqa3-bs48-d96"),
    pytest.param(2, 1, 128, 32, None, None, id="gqa2-bs128-d32-default-tiles"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "block_size", "head_dim", "block_m", "block_n"), PREFILL_CASES
)
def test_prefill_matches_reference(
    kernels, device, dtype, num_heads, num_kv_heads, block_size, head_dim, block_m, block_n
):
    g = torch.Generator().manual_seed(14)
    # (cached prefix, chunk): a whole prompt, a chunk after a prefix ending mid-block, a
    # decode token, an empty chunk, a chunk starting exactly on a block boundary.
    shapes = [(0, 37), (block_size + 3, 21), (2 * block_size - 1, 1), (4, 0), (block_size, 9)]
    seq_lens = [p + c for p, c in shapes]
    q_lens = [c for _, c in shapes]
    case = _to(
        make_paged_case(
            seq_lens,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            block_size=block_size,
            dtype=dtype,
            generator=g,
        ),
        device,
    )
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(dtype).to(device)
    args = (
        q,
        case.k_cache,
        case.v_cache,
        _cu_seqlens(q_lens).to(device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device),
        case.block_tables,
        head_dim**-0.5,
        max(q_lens),
    )
    want = reference.paged_attention_prefill(*args)
    got = kernels["prefill_attention"].paged_attention_prefill(
        *args, block_m=block_m, block_n=block_n
    )
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_prefill_of_length_one_chunks_equals_decode(kernels, device):
    """A batch of one-token chunks is a decode batch: both kernels must agree."""
    g = torch.Generator().manual_seed(15)
    seq_lens = [1, 30, 17]
    case = _to(
        make_paged_case(
            seq_lens, num_kv_heads=2, head_dim=64, block_size=8, dtype=torch.float32, generator=g
        ),
        device,
    )
    q = torch.randn(3, 4, 64, generator=g).to(device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    prefill = kernels["prefill_attention"].paged_attention_prefill(
        q,
        case.k_cache,
        case.v_cache,
        _cu_seqlens([1, 1, 1]).to(device),
        lens,
        case.block_tables,
        0.125,
        1,
        block_m=16,
        block_n=16,
    )
    decode = kernels["decode_attention"].paged_attention_decode(
        q, case.k_cache, case.v_cache, case.block_tables, lens, 0.125, num_splits=2, block_n=16
    )
    torch.testing.assert_close(prefill, decode, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [1000, 64])
def test_rms_norm_matches_reference(kernels, device, dtype, hidden):
    g = torch.Generator().manual_seed(16)
    x = (3 * torch.randn(7, hidden, generator=g)).to(dtype).to(device)
    w = torch.randn(hidden, generator=g).to(dtype).to(device)
    got = kernels["norm"].rms_norm(x, w, 1e-6)
    assert got.dtype == dtype
    torch.testing.assert_close(got, reference.rms_norm(x, w, 1e-6), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_matches_reference_and_overwrites_residual(kernels, device, dtype):
    g = torch.Generator().manual_seed(17)
    x = torch.randn(5, 200, generator=g).to(dtype).to(device)
    residual = torch.randn(5, 200, generator=g).to(dtype).to(device)
    w = torch.randn(200, generator=g).to(dtype).to(device)
    x_before = x.clone()
    ref_residual = residual.clone()
    want_out, _ = reference.fused_add_rms_norm(x, ref_residual, w, 1e-5)
    out, res = kernels["norm"].fused_add_rms_norm(x, residual, w, 1e-5)
    assert res is residual
    torch.testing.assert_close(residual, ref_residual, atol=0, rtol=0)
    torch.testing.assert_close(out, want_out, **TOL[dtype])
    assert torch.equal(x, x_before)


def _rope_cache(max_pos: int, rotary_dim: int) -> torch.Tensor:
    inv_freq = 10000.0 ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1).float()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_rotary_matches_reference_on_fused_qkv_views(kernels, device, dtype, is_neox, rotary_dim):
    g = torch.Generator().manual_seed(18)
    num_tokens, num_heads, num_kv_heads, head_dim = 9, 6, 2, 64
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=g).to(dtype).to(device)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(
        num_tokens, num_kv_heads, head_dim
    )
    positions = torch.tensor([0, 1, 2, 17, 500, 1023, 3, 3, 64], device=device)
    cache = _rope_cache(1024, rotary_dim).to(device)
    want = qkv.clone()
    wq = want[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    wk = want[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(
        num_tokens, num_kv_heads, head_dim
    )
    reference.rotary_embedding_(positions, wq, wk, cache, is_neox)
    before = qkv.clone()
    kernels["rotary"].rotary_embedding_(positions, q, k, cache, is_neox)
    torch.testing.assert_close(qkv, want, **TOL[dtype])  # v and unrotated channels included
    assert not torch.equal(qkv[3], before[3])  # position 17: really rotated


def test_ops_forced_triton_backend_runs_the_kernels(kernels, device, monkeypatch):
    """ATOM_KERNEL_BACKEND=triton routes ops to the kernels even for CPU tensors."""
    monkeypatch.setenv(ops.BACKEND_ENV, "triton")
    ops.refresh_backend()
    calls = []
    real = kernels["norm"].rms_norm
    monkeypatch.setattr(kernels["norm"], "rms_norm", lambda *a: calls.append(1) or real(*a))
    ops.refresh_backend()  # rebinds the launchers to the patched function
    try:
        x = torch.randn(3, 40, device=device)
        w = torch.randn(40, device=device)
        torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))
        assert calls == [1]
    finally:
        monkeypatch.delenv(ops.BACKEND_ENV)
        ops.refresh_backend()

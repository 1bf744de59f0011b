"""Compiled-kernel checks that need a GPU: bf16, realistic shapes, CUDA-graph capture, and
automatic dispatch. Skipped (with a reason, by tests/conftest.py) when there is no GPU."""

from __future__ import annotations

import pytest
import torch
from paged_cases import make_paged_case

from atom_kernels import ops, reference

pytestmark = pytest.mark.gpu

BF16_TOL = dict(atol=1.5e-2, rtol=1.5e-2)


def _cuda_case(seq_lens, *, num_kv_heads, head_dim, block_size, dtype, seed):
    case = make_paged_case(
        seq_lens,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        generator=torch.Generator().manual_seed(seed),
    )
    case.k_cache = case.k_cache.cuda()
    case.v_cache = case.v_cache.cuda()
    case.block_tables = case.block_tables.cuda()
    return case


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(32, 8, 128), (16, 16, 64)])
@pytest.mark.parametrize("block_size", [16, 48])
def test_decode_realistic_shapes(kernels, dtype, num_heads, num_kv_heads, head_dim, block_size):
    g = torch.Generator().manual_seed(20)
    seq_lens = torch.randint(1, 3000, (24,), generator=g).tolist()
    seq_lens[5] = 0
    seq_lens[7] = 4100  # longest: several splits when the batch is small
    case = _cuda_case(
        seq_lens,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=21,
    )
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=g).to(dtype).cuda()
    lens = torch.tensor(seq_lens, dtype=torch.int32).cuda()
    args = (q, case.k_cache, case.v_cache, case.block_tables, lens, head_dim**-0.5)
    want = reference.paged_attention_decode(*args)
    for splits in (None, 1, 8):
        got = kernels["decode_attention"].paged_attention_decode(*args, num_splits=splits)
        torch.testing.assert_close(got, want, **BF16_TOL)
    assert torch.equal(got[5], torch.zeros_like(got[5]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_w1_batch_two_heads_a_program(kernels, dtype):
    """W1's decode shape (batch 256, Qwen3-0.6B heads) takes two KV heads a program on its own
    choice; same output as one head a program and the reference."""
    decode_attention = kernels["decode_attention"]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert decode_attention.decode_heads_per_program(256, 8, 2, 128, 1, sms) == 2
    g = torch.Generator().manual_seed(22)
    seq_lens = torch.randint(1, 1500, (256,), generator=g).tolist()
    seq_lens[9] = 0
    case = _cuda_case(seq_lens, num_kv_heads=8, head_dim=128, block_size=16, dtype=dtype, seed=23)
    q = torch.randn(256, 16, 128, generator=g).to(dtype).cuda()
    lens = torch.tensor(seq_lens, dtype=torch.int32).cuda()
    args = (q, case.k_cache, case.v_cache, case.block_tables, lens, 128**-0.5)
    want = reference.paged_attention_decode(*args)
    got = decode_attention.paged_attention_decode(*args, num_splits=1)
    one = decode_attention.paged_attention_decode(*args, num_splits=1, heads_per_program=1)
    torch.testing.assert_close(got, want, **BF16_TOL)
    torch.testing.assert_close(got, one, **BF16_TOL)
    assert torch.equal(got[9], torch.zeros_like(got[9]))


@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_prefill_realistic_shapes(kernels, dtype, head_dim):
    shapes = [(0, 1000), (517, 300), (2000, 1), (33, 129)]
    seq_lens = [p + c for p, c in shapes]
    q_lens = [c for _, c in shapes]
    case = _cuda_case(
        seq_lens, num_kv_heads=4, head_dim=head_dim, block_size=16, dtype=dtype, seed=22
    )
    g = torch.Generator().manual_seed(23)
    q = torch.randn(sum(q_lens), 16, head_dim, generator=g).to(dtype).cuda()
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32).cuda()
    args = (
        q,
        case.k_cache,
        case.v_cache,
        cu,
        torch.tensor(seq_lens, dtype=torch.int32).cuda(),
        case.block_tables,
        head_dim**-0.5,
        max(q_lens),
    )
    want = reference.paged_attention_prefill(*args)
    got = kernels["prefill_attention"].paged_attention_prefill(*args)
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(got, want, **tol)


def _prefill_args(shapes, *, num_heads, num_kv_heads, head_dim, dtype, seed, block_size=16):
    seq_lens = [p + c for p, c in shapes]
    q_lens = [c for _, c in shapes]
    case = _cuda_case(
        seq_lens,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=seed,
    )
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(dtype).cuda()
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32).cuda()
    lens = torch.tensor(seq_lens, dtype=torch.int32).cuda()
    return (q, case.k_cache, case.v_cache, cu, lens, case.block_tables, head_dim**-0.5,
            max(q_lens))  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(16, 8, 128), (32, 8, 128), (16, 4, 256)]
)
def test_prefill_split_kv_over_long_cached_prefixes(kernels, dtype, num_heads, num_kv_heads,
                                                    head_dim):  # fmt: skip
    """W3's shape (64 new tokens over 8,000 cached) and a mixed batch of very different
    lengths: automatic, forced and no splits all match the reference."""
    mod = kernels["prefill_attention"]
    for shapes in ([(8000, 64)], [(8000, 64), (3001, 37), (0, 64), (100, 1), (517, 300)]):
        args = _prefill_args(shapes, num_heads=num_heads, num_kv_heads=num_kv_heads,
                             head_dim=head_dim, dtype=dtype, seed=60)  # fmt: skip
        want = reference.paged_attention_prefill(*args)
        for splits in (None, 1, 5, 16, 32):
            got = mod.paged_attention_prefill(*args, num_splits=splits)
            torch.testing.assert_close(got, want, **BF16_TOL)


@pytest.mark.parametrize("head_dim", [128, 256])
def test_prefill_candidates_compile_and_match_reference(kernels, head_dim):
    """Every launch setting the sweep may pick gives the reference's answer (a candidate
    that does not fit the device's shared memory is skipped, as the sweep skips it)."""
    from triton.runtime.errors import OutOfResources

    mod = kernels["prefill_attention"]
    args = _prefill_args([(0, 1000), (517, 300), (8000, 64)], num_heads=16, num_kv_heads=4,
                         head_dim=head_dim, dtype=torch.bfloat16, seed=62)  # fmt: skip
    want = reference.paged_attention_prefill(*args)
    for name, launch in mod.PREFILL_CANDIDATES[head_dim]:
        if launch.get("warp_specialize") and not mod.HAS_WARP_SPECIALIZE:
            continue
        try:
            got = mod.paged_attention_prefill(*args, **launch)
        except OutOfResources:
            continue
        torch.testing.assert_close(got, want, **BF16_TOL, msg=lambda m, n=name: f"{n}: {m}")


def test_prefill_split_replays_in_a_cuda_graph_with_new_lengths(kernels, monkeypatch):
    """The split count comes from shapes only: a split prefill captured once stays correct
    when lengths, chunk offsets and block tables change in place between replays."""
    monkeypatch.delenv(ops.BACKEND_ENV, raising=False)
    ops.refresh_backend()
    shapes = [(4000, 64), (1000, 64)]
    q, k_cache, v_cache, cu, lens, tables, scale, max_q = _prefill_args(
        shapes, num_heads=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, seed=64
    )
    assert (
        kernels["prefill_attention"].choose_prefill_splits(
            16, tables.shape[1] * 16, 64, torch.cuda.get_device_properties(0).multi_processor_count
        )
        > 1
    )
    static_tables = tables.clone()
    out = torch.empty_like(q)

    def step():
        ops.paged_attention_prefill(q, k_cache, v_cache, cu, lens, static_tables, scale, max_q,
                                    out)  # fmt: skip

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    stored = [4064, 1064]  # tokens each sequence's blocks hold
    for new in ([(4000, 64), (1000, 64)], [(64, 64), (2000, 3)], [(1000, 28), (100, 60)]):
        # Rows swap block tables on the second round: sequence i now reads the other's blocks.
        swap = new[0][0] == 64
        static_tables.copy_(tables.roll(1, 0) if swap else tables)
        room = stored[::-1] if swap else stored
        new_lens = [min(p + c, r) for (p, c), r in zip(new, room, strict=True)]
        q_lens = [c for _, c in new]
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        cu.copy_(torch.tensor([0, q_lens[0], q_lens[0] + q_lens[1]], dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        want = reference.paged_attention_prefill(q, k_cache, v_cache, cu, lens, static_tables,
                                                 scale, max_q)  # fmt: skip
        n = sum(q_lens)
        torch.testing.assert_close(out[:n], want[:n], **BF16_TOL)


@pytest.mark.parametrize("head_dim", [96, 256])
def test_decode_other_head_dims(kernels, head_dim):
    seq_lens = [1, 700, 33, 0, 2048]
    case = _cuda_case(
        seq_lens, num_kv_heads=2, head_dim=head_dim, block_size=16, dtype=torch.float16, seed=24
    )
    q = torch.randn(5, 8, head_dim, generator=torch.Generator().manual_seed(25)).half().cuda()
    lens = torch.tensor(seq_lens, dtype=torch.int32).cuda()
    args = (q, case.k_cache, case.v_cache, case.block_tables, lens, head_dim**-0.5)
    got = kernels["decode_attention"].paged_attention_decode(*args)
    torch.testing.assert_close(got, reference.paged_attention_decode(*args), **BF16_TOL)


def test_decode_replays_in_a_cuda_graph_with_new_lengths(kernels, monkeypatch):
    """Captured once with static buffers, the graph stays correct when the lengths and
    block tables change between replays (including a padded row of length 0)."""
    monkeypatch.delenv(ops.BACKEND_ENV, raising=False)
    ops.refresh_backend()
    seq_lens = [300, 1, 1025, 77]
    case = _cuda_case(
        seq_lens, num_kv_heads=2, head_dim=128, block_size=16, dtype=torch.bfloat16, seed=26
    )
    g = torch.Generator().manual_seed(27)
    q = torch.randn(4, 8, 128, generator=g).bfloat16().cuda()
    lens = torch.tensor(seq_lens, dtype=torch.int32).cuda()
    tables = case.block_tables.clone()
    out = torch.empty_like(q)

    def step():
        ops.paged_attention_decode(q, case.k_cache, case.v_cache, tables, lens, 0.088, out)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    for new_lens in ([300, 1, 1025, 77], [12, 0, 1024, 200], [1025, 1025, 1, 0]):
        # Rows rotate through the sequences' block tables to change the gathers too.
        shift = new_lens[0] % 4
        tables.copy_(case.block_tables.roll(shift, 0))
        # Row i now holds sequence (i - shift)'s blocks: cap its length at what is stored.
        usable = [min(n, seq_lens[(i - shift) % 4]) for i, n in enumerate(new_lens)]
        lens.copy_(torch.tensor(usable, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        want = reference.paged_attention_decode(q, case.k_cache, case.v_cache, tables, lens, 0.088)
        torch.testing.assert_close(out, want, **BF16_TOL)


def test_ops_dispatch_to_triton_on_gpu_tensors(kernels, monkeypatch):
    monkeypatch.delenv(ops.BACKEND_ENV, raising=False)
    ops.refresh_backend()
    assert ops.backend_for(torch.zeros(1, device="cuda")) == "triton"
    assert ops.backend_for(torch.zeros(1)) == "torch"


def test_small_ops_bf16(kernels):
    g = torch.Generator().manual_seed(28)
    x = torch.randn(300, 4096, generator=g).bfloat16().cuda()
    res = torch.randn(300, 4096, generator=g).bfloat16().cuda()
    w = torch.randn(4096, generator=g).bfloat16().cuda()
    torch.testing.assert_close(
        kernels["norm"].rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6), **BF16_TOL
    )
    ref_res = res.clone()
    want, _ = reference.fused_add_rms_norm(x, ref_res, w, 1e-6)
    got, _ = kernels["norm"].fused_add_rms_norm(x, res, w, 1e-6)
    torch.testing.assert_close(res, ref_res, atol=0, rtol=0)
    torch.testing.assert_close(got, want, **BF16_TOL)

    qkv = torch.randn(300, (32 + 16) * 128, generator=g).bfloat16().cuda()
    q = qkv[:, : 32 * 128].view(300, 32, 128)
    k = qkv[:, 32 * 128 : 40 * 128].view(300, 8, 128)
    positions = torch.randint(0, 8192, (300,), generator=g).cuda()
    inv_freq = 1e6 ** (-torch.arange(0, 128, 2, dtype=torch.float64) / 128)
    angles = torch.arange(8192, dtype=torch.float64)[:, None] * inv_freq
    cache = torch.cat((angles.cos(), angles.sin()), -1).float().cuda()
    want = qkv.clone()
    reference.rotary_embedding_(
        positions,
        want[:, : 32 * 128].view(300, 32, 128),
        want[:, 32 * 128 : 40 * 128].view(300, 8, 128),
        cache,
    )
    kernels["rotary"].rotary_embedding_(positions, q, k, cache)
    torch.testing.assert_close(qkv, want, **BF16_TOL)

    slots = torch.randperm(64 * 16, generator=g)[:300].cuda()
    slots[::7] = -1
    kc = torch.zeros(64, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
    vc = torch.zeros_like(kc)
    kw, vw = kc.clone(), vc.clone()
    reference.store_kvcache(k, k, kw, vw, slots)
    kernels["kv_cache"].store_kvcache(k, k, kc, vc, slots)
    assert torch.equal(kc, kw) and torch.equal(vc, vw)


def test_gemv_ticket_merge_agrees_with_the_reduce_kernel_under_load(kernels):
    """Many programs racing for the same counters, launch after launch: the last-to-arrive
    merge must see every split's stores (the barrier + acquire-release ticket), so each
    launch equals the two-launch merge bit for bit (same summation order)."""
    from atom_kernels import gemv

    g = torch.Generator().manual_seed(30)
    for n, k in [(4096, 4096), (4096, 14336), (1024, 2048)]:
        w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16().cuda()
        x = torch.randn(1, k, generator=g).bfloat16().cuda()
        want = gemv.gemv(x, w, merge="kernel")
        assert (
            gemv.gemv_config(n, k, torch.cuda.get_device_properties(0).multi_processor_count)[
                "split"
            ]
            > 1
        )
        for _ in range(50):
            assert torch.equal(gemv.gemv(x, w), want)


def test_gemv_falls_back_to_the_reduce_kernel_when_capture_needs_new_counters(kernels, monkeypatch):
    """Counters cannot be allocated inside a CUDA-graph capture: the launch captured then
    uses the separate merge kernel and still replays correctly."""
    from atom_kernels import gemv, tickets

    monkeypatch.setattr(tickets, "_counters", {})
    g = torch.Generator().manual_seed(32)
    w = (torch.randn(1024, 4096, generator=g) / 64).bfloat16().cuda()
    x = torch.randn(1, 4096, generator=g).bfloat16().cuda()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        gemv.gemv(x, w, merge="kernel")  # compiles outside the capture, allocates no counters
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        assert tickets.ticket_counters(x.device, 8) is None
        out = gemv.gemv(x, w)
    for _ in range(3):
        x.copy_(torch.randn(1, 4096, generator=g).bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, gemv.gemv(x, w, merge="kernel"))


def _qkv_views(total, num_heads, num_kv_heads, head_dim, dtype, seed, q_gate=False):
    """q, k, v as the attention layer holds them after `prepare`: views into one fused qkv
    tensor (q strided past its output gates with `q_gate`)."""
    g = torch.Generator().manual_seed(seed)
    q_width = (2 if q_gate else 1) * head_dim
    q_end, kv = num_heads * q_width, num_kv_heads * head_dim
    qkv = torch.randn(total, q_end + 2 * kv, generator=g).to(dtype).cuda()
    q = qkv[:, :q_end].view(total, num_heads, q_width)[..., :head_dim]
    k = qkv[:, q_end : q_end + kv].view(total, num_kv_heads, head_dim)
    v = qkv[:, q_end + kv :].view(total, num_kv_heads, head_dim)
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "q_gate"),
    [(32, 8, 128, False), (16, 8, 128, False), (16, 4, 256, True), (12, 12, 64, False)],
)
@pytest.mark.parametrize(
    "lens",
    [(300, 1, 37, 130, 5), (777,), (2048, 2100)],
    ids=["flash-short-chunks", "sdpa-one-chunk", "flash-long-chunks"],
)
def test_dense_prefill_of_fresh_chunks_matches_the_reference(
    num_heads, num_kv_heads, head_dim, q_gate, dtype, lens
):
    """The dense path on strided q/k/v views, each of its ways: several chunks of awkward lengths
    (a one-token chunk among them) in one flash launch, one chunk through SDPA padded to its
    bucket (777 -> 832 rows): the torch reference's output, and `supported` says so."""
    from atom_kernels import varlen_attention

    q, k, v = _qkv_views(sum(lens), num_heads, num_kv_heads, head_dim, dtype, 70, q_gate)
    offsets = [0]
    for n in lens:
        offsets.append(offsets[-1] + n)
    cu = torch.tensor(offsets, dtype=torch.int32, device="cuda")
    args = (q, k, v, cu, lens, head_dim**-0.5, max(lens))
    got = ops.varlen_causal_attention(*args)
    torch.testing.assert_close(got, reference.varlen_causal_attention(*args), **BF16_TOL)
    assert varlen_attention.supported(
        torch.device("cuda"), dtype, num_heads, num_kv_heads, head_dim
    )


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "q_gate"),
    [(32, 8, 128, False), (16, 8, 128, False), (16, 4, 256, True)],
)
def test_cudnn_called_directly_equals_sdpa_and_is_taken_after_the_probe(
    num_heads, num_kv_heads, head_dim, q_gate
):
    """cuDNN's aten op called directly gives SDPA's (cuDNN's) output on a padded chunk, and once
    `supported` has probed these heads the one-chunk path calls it (`_CUDNN_DIRECT`)."""
    from atom_kernels import varlen_attention

    q, k, v = _qkv_views(1500, num_heads, num_kv_heads, head_dim, torch.bfloat16, 71, q_gate)
    scale = head_dim**-0.5
    q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))
    direct = varlen_attention._causal(q, k, v, scale, cudnn_direct=True)
    sdpa = varlen_attention._causal(q, k, v, scale, cudnn_direct=False)
    torch.testing.assert_close(direct, sdpa, **BF16_TOL)
    assert varlen_attention.supported(
        torch.device("cuda"), torch.bfloat16, num_heads, num_kv_heads, head_dim
    )
    assert (num_heads, num_kv_heads, head_dim, torch.bfloat16) in varlen_attention._CUDNN_DIRECT


def test_dense_prefill_is_not_offered_for_fp32():
    from atom_kernels import varlen_attention

    assert not varlen_attention.supported(torch.device("cuda"), torch.float32, 16, 8, 128)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "q_gate"),
    [(32, 8, 128, False), (16, 8, 128, False), (16, 4, 256, True)],
)
@pytest.mark.parametrize("n", [1500, 5003])
def test_dense_prefill_pads_a_chunk_and_agrees_with_unpadded_sdpa(
    num_heads, num_kv_heads, head_dim, q_gate, n
):
    """One chunk of a length no bucket has (1,500 -> 1,536 rows, 5,003 -> 5,120), padded at its
    end, gives the output of SDPA (cuDNN, else flash) on the unpadded chunk, bf16."""
    from atom_kernels import varlen_attention

    q, k, v = _qkv_views(n, num_heads, num_kv_heads, head_dim, torch.bfloat16, 72, q_gate)
    cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    scale = head_dim**-0.5
    got = ops.varlen_causal_attention(q, k, v, cu, (n,), scale, n)
    assert got.shape == (n, num_heads, head_dim)
    want = varlen_attention.sdpa_causal_rows(q, k, v, scale)
    torch.testing.assert_close(got, want, **BF16_TOL)


def test_dense_prefill_after_the_warm_up_new_lengths_find_a_built_plan(monkeypatch):
    """cuDNN keys its attention plans by the tensors' sizes, strides, dtype and device (and
    causal, dropout, softmax statistics: constant here). After `warm_up` for a 4,096-token budget,
    chunks of lengths it never saw reach SDPA with a key the warm-up already presented, so no
    plan is built for them (the time of those first calls: benchmarks/prefill_dense_bench.py)."""
    from atom_kernels import varlen_attention

    keys = []
    real = varlen_attention.sdpa_causal

    def record(q, k, v, scale):
        keys.append(tuple((t.shape, t.stride(), t.dtype, t.device) for t in (q, k, v)))
        return real(q, k, v, scale)

    monkeypatch.setattr(varlen_attention, "sdpa_causal", record)
    with torch.inference_mode():
        warmed = varlen_attention.warm_up(torch.device("cuda"), torch.bfloat16, 32, 8, 128, 4096)
        assert warmed == varlen_attention.bucket_lengths(4096) and len(keys) == len(warmed)
        for n in (3073, 3333, 3900, 4096):
            q, k, v = _qkv_views(n, 32, 8, 128, torch.bfloat16, n)
            cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
            ops.varlen_causal_attention(q, k, v, cu, (n,), 128**-0.5, n)
            assert keys[-1] in keys[: len(warmed)], n


def test_dense_prefill_replays_in_a_cuda_graph_with_new_chunks():
    """Captured once, the dense op stays correct when q/k/v and the chunk offsets change in place
    (chunks no longer than the captured longest, which sizes the launch)."""
    q, k, v = _qkv_views(1024, 32, 8, 128, torch.bfloat16, 71)
    cu = torch.tensor([0, 700, 1000, 1024], dtype=torch.int32, device="cuda")
    scale = 128**-0.5
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops.varlen_causal_attention(q, k, v, cu, (700, 300, 24), scale, 700)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.varlen_causal_attention(q, k, v, cu, (700, 300, 24), scale, 700)
    for t in (q, k, v):
        t.copy_(torch.randn_like(t))
    cu.copy_(torch.tensor([0, 600, 1000, 1024], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    want = reference.varlen_causal_attention(q, k, v, cu, (600, 400, 24), scale, 700)
    torch.testing.assert_close(out, want, **BF16_TOL)

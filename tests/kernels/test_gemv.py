"""The batch-1 GEMV (`atom_kernels.gemv`, behind `ops.linear_small_m`) against F.linear, its
SwiGLU epilogue against F.linear + `reference.silu_and_mul`, and its fused RMSNorm prologue.

On CPU the kernel runs under TRITON_INTERPRET=1 (fp32, fp16); on a GPU compiled (bf16 too).
Shapes are awkward on purpose (N not a multiple of BLOCK_N, K not a multiple of BLOCK_K) and
small, since the interpreter is slow; the split-K path is forced with a small BLOCK_K."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from atom_kernels import ops, reference

HAS_GPU = torch.cuda.is_available()
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_GPU else [])
TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
SHAPES = [(37, 300), (100, 1500), (64, 2048)]  # (N, K)
# (split asked for, BLOCK_K): None = the unsplit path at the default BLOCK_K.
PATHS = [(1, None), (2, 32), (3, 32), (4, 32)]


@pytest.fixture(scope="module")
def gemv_mod(kernels):
    """`atom_kernels.gemv`, interpreted on CPU and compiled on a GPU (conftest's `kernels`)."""
    return kernels["gemv"]


def _inputs(n, k, dtype, device, *, bias, act, seed=11):
    """x [1, K] and a weight of N output features: [gate; up], 2N rows, with act."""
    g = torch.Generator().manual_seed(seed + n + k)
    rows = 2 * n if act == "silu_mul" else n
    x = torch.randn(1, k, generator=g).to(dtype).to(device)
    w = (torch.randn(rows, k, generator=g) * (3 if act else 1) / k**0.5).to(dtype).to(device)
    b = torch.randn(rows, generator=g).to(dtype).to(device) if bias else None
    return x, w, b


def _want(x, w, b, act):
    y = F.linear(x, w, b)
    return reference.silu_and_mul(y) if act == "silu_mul" else y


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize(("split", "block_k"), PATHS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("act", [None, "silu_mul"])
@pytest.mark.parametrize("early", [None, 1024])
def test_gemv_matches_linear(gemv_mod, device, dtype, n, k, split, block_k, bias, act, early):
    """`early`: the columns loaded before the wait are the default (one step off Hopper: every
    later step goes through the loop) or 1,024 (most or all of a split at these sizes, so the
    loop hardly runs)."""
    if block_k is not None:  # the requested split really is what launches
        assert gemv_mod.split_k(k, split, block_k)[1] == split
    x, w, b = _inputs(n, k, dtype, device, bias=bias, act=act)
    got = gemv_mod.gemv(x, w, b, act=act, split=split, block_k=block_k, early=early)
    want = _want(x, w, b, act)
    assert got.shape == (1, n) and got.dtype == dtype
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_early_columns_are_a_power_of_two_multiple_of_a_step_within_the_split(monkeypatch):
    from atom_kernels.gemv import early_columns

    monkeypatch.delenv("ATOM_GEMV_EARLY", raising=False)
    assert early_columns(128, 2560, {}) == 1024  # the default under PDL
    assert early_columns(128, 2560, {}, pdl_on=False) == 128  # one step without it
    assert early_columns(128, 2560, {"early": 128}) == 128
    assert early_columns(128, 2560, {"early": 700}) == 512  # rounded down to 4 steps
    assert early_columns(128, 300, {}) == 512  # 3 steps, rounded up to 4
    assert early_columns(256, 100, {"early": 128}) == 256  # never less than one step
    assert early_columns(32, 2048, {"early": 4096}) == 2048


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_ticket_merge_equals_the_reduce_kernel_and_resets(gemv_mod, device, dtype, bias):
    """The last split of each column block sums the splits in split order, like the reduce
    kernel (so the results are equal bit for bit), and leaves its counter at zero: the next
    launch, as in a replayed CUDA graph, merges exactly once again."""
    from atom_kernels.tickets import ticket_counters

    n, k = 40, 384
    for seed in range(3):
        x, w, b = _inputs(n, k, dtype, device, bias=bias, act=None, seed=seed)
        tickets = gemv_mod.gemv(x, w, b, split=3, block_k=32)
        reduced = gemv_mod.gemv(x, w, b, split=3, block_k=32, merge="kernel")
        assert torch.equal(tickets, reduced)
        torch.testing.assert_close(tickets, F.linear(x, w, b), **TOL[dtype])
        assert not ticket_counters(device, 3)[:3].any()
    with pytest.raises(ValueError, match="merge="):
        gemv_mod.gemv(x, w, merge="atomic")


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_other_block_n_and_strided_weight_rows(gemv_mod, device, dtype):
    """BLOCK_N 32 over N=37 (one full, one ragged tile), and weight rows with padding after
    them (a column slice of a wider matrix): only stride(1) must be 1."""
    n, k = 37, 300
    x, _, b = _inputs(n, k, dtype, device, bias=True, act=None)
    wide = (torch.randn(n, k + 20, generator=torch.Generator().manual_seed(2)) / k**0.5).to(dtype)
    w = wide.to(device)[:, :k]
    assert not w.is_contiguous() and w.stride(1) == 1
    for split, block_k in [(1, None), (3, 32)]:
        got = gemv_mod.gemv(x, w, b, split=split, block_k=block_k, block_n=32)
        torch.testing.assert_close(got, F.linear(x, w, b), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("split", "block_k"), [(1, None), (3, 32)])
@pytest.mark.parametrize("block_n", [None, 4, 32])  # 32 rows: 16 outputs, a ragged block
def test_gemv_swiglu_matches_the_two_step_path(gemv_mod, device, dtype, split, block_k, block_n):
    """Against the GEMV's own [gate; up] output then silu_and_mul, as the runtime runs it
    without the fusion; the ticket sum and the reduce kernel agree bit for bit."""
    n, k = 24, 300
    x, w, b = _inputs(n, k, dtype, device, bias=True, act="silu_mul", seed=5)
    shape = dict(split=split, block_k=block_k, block_n=block_n)
    got = gemv_mod.gemv(x, w, b, act="silu_mul", **shape)
    assert got.shape == (1, n)
    want = ops.silu_and_mul(gemv_mod.gemv(x, w, b, split=split, block_k=block_k))
    torch.testing.assert_close(got, want, **TOL[dtype])
    merged = gemv_mod.gemv(x, w, b, act="silu_mul", **shape, merge="kernel")
    assert torch.equal(got, merged)


def test_gemv_paired_epilogue_needs_an_even_power_of_two_block(gemv_mod, device):
    """A paired epilogue interleaves each output's two rows in its block of rows."""
    x, w, _ = _inputs(8, 64, torch.float32, device, bias=False, act="silu_mul")
    for block_n in (1, 6):
        with pytest.raises(ValueError, match=f"block_n={block_n}"):
            gemv_mod.gemv(x, w, act="silu_mul", block_n=block_n)


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float32])
@pytest.mark.parametrize(("split", "block_k"), [(1, None), (2, 32)])
def test_gemv_swiglu_rounds_gate_and_up_first(gemv_mod, device, dtype, split, block_k):
    """The gate and up sums are rounded to the output dtype before silu(gate) * up, as the
    separate GEMV output would be. Here the gate sums to 1 + half a unit in the last place
    (rounds to 1) and up is large, so skipping the rounding lands on another representable
    value, which random data would hide inside any tolerance."""
    k = 64
    ulp = torch.finfo(dtype).eps  # spacing of the dtype at 1.0
    up = 32.0 / ulp  # a power of two: the result's spacing is about silu' * ulp/2 * up
    w = torch.zeros(2, k)
    w[0, 0], w[0, 1], w[1, 0] = 1.0, ulp / 2, up
    w = w.to(dtype)
    assert w[0, 1].item() == ulp / 2  # the half-ulp term is representable on its own
    x = torch.ones(1, k, dtype=dtype)
    exact = reference.silu_and_mul(torch.tensor([[1.0, up]]).to(dtype))  # gate rounded to 1
    unrounded = (F.silu(torch.tensor(1.0 + ulp / 2)) * up).to(dtype)
    if unrounded.item() == exact.item():
        pytest.skip("this dtype's spacing hides the difference")
    got = gemv_mod.gemv(x.to(device), w.to(device), act="silu_mul", split=split, block_k=block_k)
    assert got.item() == exact.item()


def test_linear_small_m_forced_triton_runs_the_gemv(gemv_mod, device, monkeypatch):
    """ATOM_KERNEL_BACKEND=triton sends linear_small_m to the kernel even for CPU tensors (the
    interpreter), with the default launch shape: N=20, K=2048 splits K in two here."""
    from atom_kernels.gemv import gemv_config

    n, k = 20, 2048
    cfg = gemv_config(n, k, gemv_mod._multiprocessors(torch.device(device)))
    if not HAS_GPU:
        assert cfg["split"] == 2
    calls = []
    real = gemv_mod.gemv
    monkeypatch.setattr(gemv_mod, "gemv", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    monkeypatch.setenv(ops.BACKEND_ENV, "triton")
    ops.refresh_backend()
    try:
        for act in (None, "silu_mul"):
            x, w, b = _inputs(n, k, torch.float32, device, bias=True, act=act)
            got = ops.linear_small_m(x, w, b, act=act)
            torch.testing.assert_close(got, _want(x, w, b, act), **TOL[torch.float32])
    finally:
        monkeypatch.delenv(ops.BACKEND_ENV)
        ops.refresh_backend()
    assert [c["act"] for c in calls] == [None, "silu_mul"]


def test_linear_small_m_torch_path_matches_reference(monkeypatch):
    monkeypatch.setenv(ops.BACKEND_ENV, "torch")
    ops.refresh_backend()
    try:
        x, w, b = _inputs(10, 24, torch.float32, "cpu", bias=True, act="silu_mul")
        got = ops.linear_small_m(x, w, b, act="silu_mul")
        assert torch.equal(got, reference.silu_and_mul(F.linear(x, w, b)))
        x, w, b = _inputs(10, 24, torch.float32, "cpu", bias=False, act=None)
        assert torch.equal(ops.linear_small_m(x, w), F.linear(x, w))
    finally:
        monkeypatch.delenv(ops.BACKEND_ENV)
        ops.refresh_backend()


def test_linear_small_m_refuses_bad_shapes():
    w = torch.zeros(8, 16)
    with pytest.raises(ValueError, match="one contiguous row"):
        ops.linear_small_m(torch.zeros(2, 16), w)  # two rows
    with pytest.raises(ValueError, match="one contiguous row"):
        ops.linear_small_m(torch.zeros(16), w)  # not 2-D
    with pytest.raises(ValueError, match=r"one contiguous row \[1, 16\]"):
        ops.linear_small_m(torch.zeros(1, 15), w)  # wrong K
    with pytest.raises(ValueError, match="one contiguous row"):
        ops.linear_small_m(torch.zeros(1, 32)[:, ::2], w)  # strided x
    with pytest.raises(ValueError, match="contiguous rows"):
        ops.linear_small_m(torch.zeros(1, 16), torch.zeros(16, 8).t())  # column-major weight
    with pytest.raises(ValueError, match="contiguous rows"):
        ops.linear_small_m(torch.zeros(1, 16), torch.zeros(8, 16, 1))  # not 2-D
    with pytest.raises(ValueError, match=r"bias .* must be a contiguous \[8\]"):
        ops.linear_small_m(torch.zeros(1, 16), w, torch.zeros(7))
    with pytest.raises(ValueError, match="odd N=7"):
        ops.linear_small_m(torch.zeros(1, 16), torch.zeros(7, 16), act="silu_mul")
    with pytest.raises(ValueError, match="act='gelu'"):
        ops.linear_small_m(torch.zeros(1, 16), w, act="gelu")


def test_gemv_config_depends_on_shapes_only():
    from atom_kernels.gemv import gemv_config, split_k

    # Nothing but the matrix shape, whether the weight is FP8 and the device's multiprocessor
    # count goes in (no tensor contents, no lengths), so a launch captured in a CUDA graph stays
    # valid.
    params = list(inspect.signature(gemv_config).parameters)
    assert params == ["n", "k", "multiprocessors", "fp8", "block_scaled"]
    sms = 132  # H200
    # Wide outputs already fill the device: never split (qkv, gate_up, lm_head).
    for n, k in [(4096, 1024), (6144, 1024), (151936, 1024), (9728, 4096), (12288, 8192)]:
        assert gemv_config(n, k, sms)["split"] == 1
    # Narrow outputs with long K split (o_proj, down_proj of small models) ...
    assert gemv_config(1024, 2048, sms)["split"] == 2
    assert gemv_config(1024, 3072, sms)["split"] == 2
    assert gemv_config(64, 16384, sms)["split"] == 16
    # ... but never below 1,024 columns a split, so short K stays whole.
    assert gemv_config(16, 1024, sms)["split"] == 1
    assert gemv_config(16, 2047, sms)["split"] == 1
    for n in [16, 64, 256, 1024, 2048, 4096, 16384]:
        last = 1
        for k in [256, 1000, 1024, 2048, 3000, 4096, 8192, 16384, 65536]:
            cfg = gemv_config(n, k, sms)
            assert cfg == gemv_config(n, k, sms)
            split = cfg["split"]
            assert split >= last  # longer K never splits less
            last = split
            if split > 1:
                assert k // split >= 1024
                # the launch rounds splits to whole BLOCK_K steps: none empty, none over
                k_per_split, launched = split_k(k, split, cfg["block_k"])
                assert 1 < launched <= split and (launched - 1) * k_per_split < k
                assert k_per_split >= 1024 and k_per_split % cfg["block_k"] == 0
    # Narrower N never splits less than wider N at the same K.
    for k in [2048, 8192, 65536]:
        splits = [gemv_config(n, k, sms)["split"] for n in [16, 256, 1024, 4096, 16384]]
        assert splits == sorted(splits, reverse=True)


def test_launch_candidates_start_with_the_rule_and_differ():
    from atom_kernels.gemv import launch_candidates, rule_config

    sms = 132
    for n, k in [(18432, 2560), (2560, 9216), (1024, 2048), (16, 1024)]:
        cands = launch_candidates(n, k, sms)
        assert cands[0] == rule_config(n, k, sms)
        assert len(cands) == len({tuple(sorted(c.items())) for c in cands}) >= 3
        for c in cands:  # each splits K by the rule for its own rows per program
            assert c["split"] == rule_config(n, k, sms, block_n=c["block_n"])["split"]


def test_a_timed_launch_shape_is_used_for_its_weight_shape_only(gemv_mod, device):
    """set_launch_shape overrides the rule for one [n, k] (every mode but the QK-norm
    epilogue's), the products stay right with it, and None restores the rule."""
    sms = gemv_mod._multiprocessors(torch.device(device))
    n, k = 40, 2048
    shape = gemv_mod.launch_candidates(n, k, sms)[-1]  # 8 rows a program
    assert shape != gemv_mod.rule_config(n, k, sms)
    gemv_mod.set_launch_shape(n, k, shape)
    try:
        assert gemv_mod.gemv_config(n, k, sms) == shape
        assert gemv_mod.gemv_config(n, k + 128, sms) == gemv_mod.rule_config(n, k + 128, sms)
        for act in (None, "silu_mul"):  # both on an [n, k] weight (SwiGLU: n / 2 outputs)
            outputs = n if act is None else n // 2
            x, w, b = _inputs(outputs, k, torch.float32, device, bias=True, act=act)
            assert w.shape == (n, k)
            got = gemv_mod.gemv(x, w, b, act=act)
            torch.testing.assert_close(got, _want(x, w, b, act), **TOL[torch.float32])
    finally:
        gemv_mod.set_launch_shape(n, k, None)
    assert gemv_mod.gemv_config(n, k, sms) == gemv_mod.rule_config(n, k, sms)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), [(37, 300), (64, 2048)])
@pytest.mark.parametrize(("split", "block_k"), [(1, None), (3, 32)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_gemv_with_fused_rms_norm(gemv_mod, device, dtype, n, k, split, block_k, with_residual):
    """RMSNorm (with the residual add) in front of the GEMV: the same output as the norm
    kernels' reference then F.linear, the sum written to a new tensor (the input residual is
    left alone), across the split path where each split's first programs write its columns."""
    x, w, b = _inputs(n, k, dtype, device, bias=True, act=None)
    g = torch.Generator().manual_seed(5)
    residual = torch.randn(1, k, generator=g).to(dtype).to(device) if with_residual else None
    norm_w = (torch.rand(k, generator=g) + 0.5).to(dtype).to(device)
    before = None if residual is None else residual.clone()
    got = gemv_mod.gemv(
        x, w, b, norm_weight=norm_w, residual=residual, eps=1e-5, split=split, block_k=block_k
    )
    if with_residual:
        total = before.clone()
        normed, total = reference.fused_add_rms_norm(x, total, norm_w, 1e-5)
        y, new_residual = got
        torch.testing.assert_close(new_residual, total, atol=0, rtol=0)
        torch.testing.assert_close(residual, before, atol=0, rtol=0)
    else:
        normed, y = reference.rms_norm(x, norm_w, 1e-5), got
    torch.testing.assert_close(y, F.linear(normed, w, b), **TOL[dtype])


def test_rms_norm_linear_small_m_routes_and_checks(gemv_mod, device):
    x, w, b = _inputs(40, 96, torch.float32, device, bias=True, act=None)
    residual = torch.randn_like(x)
    norm_w = torch.rand(96, device=device) + 0.5
    y, total = ops.rms_norm_linear_small_m(x, residual, norm_w, 1e-6, w, b)
    normed, want_total = reference.fused_add_rms_norm(x, residual.clone(), norm_w, 1e-6)
    torch.testing.assert_close(total, want_total)
    torch.testing.assert_close(y, F.linear(normed, w, b), **TOL[torch.float32])
    y, same = ops.rms_norm_linear_small_m(x, None, norm_w, 1e-6, w)
    assert same is x
    torch.testing.assert_close(y, F.linear(reference.rms_norm(x, norm_w, 1e-6), w))
    with pytest.raises(ValueError, match="residual"):
        ops.rms_norm_linear_small_m(x, residual[:, :10], norm_w, 1e-6, w)
    with pytest.raises(ValueError, match="norm_weight"):
        ops.rms_norm_linear_small_m(x, residual, norm_w[:10], 1e-6, w)
    with pytest.raises(ValueError, match="one contiguous row"):
        ops.rms_norm_linear_small_m(torch.cat([x, x]), None, norm_w, 1e-6, w)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("split", "block_k"), [(1, None), (3, 32)])
def test_gemv_with_fused_rms_norm_and_swiglu(gemv_mod, device, dtype, split, block_k):
    """Both fusions at once (gate_up after the post-attention norm): norm, product, SwiGLU."""
    n, k = 20, 200
    x, w, b = _inputs(n, k, dtype, device, bias=False, act="silu_mul", seed=8)
    g = torch.Generator().manual_seed(9)
    residual = torch.randn(1, k, generator=g).to(dtype).to(device)
    norm_w = (torch.rand(k, generator=g) + 0.5).to(dtype).to(device)
    y, total = gemv_mod.gemv(
        x, w, act="silu_mul", norm_weight=norm_w, residual=residual, split=split, block_k=block_k
    )
    normed, want_total = reference.fused_add_rms_norm(x, residual.clone(), norm_w, 1e-6)
    assert torch.equal(total, want_total)
    want = reference.silu_and_mul(F.linear(normed, w))
    torch.testing.assert_close(y, want, **TOL[dtype])
    via_ops, _ = ops.rms_norm_linear_small_m(x, residual, norm_w, 1e-6, w, act="silu_mul")
    assert via_ops.shape == (1, n)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 24])  # 24: a 16-pair tile straddles heads
@pytest.mark.parametrize(("split", "block_k"), [(1, None), (3, 32)])
@pytest.mark.parametrize("merge", ["tickets", "kernel"])
def test_gemv_rope_store_matches_the_unfused_path(
    gemv_mod, device, dtype, head_dim, split, block_k, merge
):
    """The qkv GEMV with rotary and the cache store in its epilogue equals the GEMV, then
    `qk_norm_rope_store_` (no QK-norm): q and k rotated in the returned row, v untouched, k and
    v in the cache slot, nothing else in the cache written."""
    heads, kv_heads, k = 4, 2, 96
    n = (heads + 2 * kv_heads) * head_dim
    x, w, b = _inputs(n, k, dtype, device, bias=True, act=None, seed=3)
    g = torch.Generator().manual_seed(4)
    angles = torch.rand(8, head_dim // 2, generator=g) * 6
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1).to(device)
    cache_shape = (3, 4, kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=g).to(dtype).to(device)
    v_cache = torch.randn(cache_shape, generator=g).to(dtype).to(device)
    positions = torch.tensor([5], device=device)
    for slot in (6, -1):
        slots = torch.tensor([slot], device=device)
        k_want, v_want = k_cache.clone(), v_cache.clone()
        want = gemv_mod.gemv(x, w, b, split=split, block_k=block_k)
        reference.qk_norm_rope_store_(
            want, positions, cos_sin, None, None, 0.0, k_want, v_want, slots, heads, kv_heads,
            head_dim,
        )  # fmt: skip
        rope = gemv_mod.RopeStore(
            positions, cos_sin, k_cache, v_cache, slots, heads, kv_heads, head_dim
        )
        got = gemv_mod.gemv(x, w, b, rope=rope, split=split, block_k=block_k, merge=merge)
        assert got.shape == (1, n)
        torch.testing.assert_close(got, want, **TOL[dtype])
        torch.testing.assert_close(k_cache, k_want, **TOL[dtype])
        torch.testing.assert_close(v_cache, v_want, **TOL[dtype])
    assert not torch.equal(got[:, : heads * head_dim], F.linear(x, w, b)[:, : heads * head_dim])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("split", "block_k"), [(1, None), (3, 16), (None, None)])
@pytest.mark.parametrize("merge", ["tickets", "kernel"])
def test_gemv_qk_norm_rope_store_matches_the_unfused_path(
    gemv_mod, device, dtype, split, block_k, merge
):
    """With QK-norm weights the epilogue norms every q and k head over its whole head_dim, then
    rotates and stores, as the GEMV followed by `qk_norm_rope_store_` with QK-norm does; v heads
    are stored unnormed. Split K (tickets or the reduce kernel) finishes each head once."""
    heads, kv_heads, head_dim, k = 4, 2, 16, 80
    n = (heads + 2 * kv_heads) * head_dim
    x, w, b = _inputs(n, k, dtype, device, bias=True, act=None, seed=5)
    g = torch.Generator().manual_seed(6)
    angles = torch.rand(8, head_dim // 2, generator=g) * 6
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1).to(device)
    q_norm = (torch.rand(head_dim, generator=g) + 0.5).to(dtype).to(device)
    k_norm = (torch.rand(head_dim, generator=g) * 2).to(dtype).to(device)
    cache_shape = (3, 4, kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=g).to(dtype).to(device)
    v_cache = torch.randn(cache_shape, generator=g).to(dtype).to(device)
    positions = torch.tensor([3], device=device)
    for slot in (9, -1):
        slots = torch.tensor([slot], device=device)
        k_want, v_want = k_cache.clone(), v_cache.clone()
        want = F.linear(x, w, b)
        reference.qk_norm_rope_store_(
            want, positions, cos_sin, q_norm, k_norm, 1e-6, k_want, v_want, slots, heads,
            kv_heads, head_dim,
        )  # fmt: skip
        rope = gemv_mod.RopeStore(
            positions, cos_sin, k_cache, v_cache, slots, heads, kv_heads, head_dim, q_norm,
            k_norm, 1e-6,
        )  # fmt: skip
        got = gemv_mod.gemv(x, w, b, rope=rope, split=split, block_k=block_k, merge=merge)
        assert got.shape == (1, n)
        torch.testing.assert_close(got, want, **TOL[dtype])
        torch.testing.assert_close(k_cache, k_want, **TOL[dtype])
        torch.testing.assert_close(v_cache, v_want, **TOL[dtype])
    # The heads really were normed: each q head has the RMS its norm weight gives it.
    q = got[0, : heads * head_dim].view(heads, head_dim).float()
    assert not torch.allclose(q, F.linear(x, w, b)[0, : heads * head_dim].view(heads, -1).float())
    with pytest.raises(ValueError, match="block_n = head_dim"):
        gemv_mod.gemv(x, w, b, rope=rope, block_n=8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rms_norm_linear_rope_store_matches_the_unfused_path(
    gemv_mod, device, dtype, with_residual, qk_norm
):
    """The input norm in the prologue and (QK-norm,) rotary and the cache store in the epilogue
    of one launch: what the norm, then `linear_rope_store_small_m` give; the residual sum comes
    back and the caller's residual is left as it was."""
    heads, kv_heads, head_dim, k = 2, 1, 16, 72
    n = (heads + 2 * kv_heads) * head_dim
    x, w, _ = _inputs(n, k, dtype, device, bias=False, act=None, seed=8)
    g = torch.Generator().manual_seed(9)
    residual = torch.randn(1, k, generator=g).to(dtype).to(device) if with_residual else None
    kept = residual.clone() if with_residual else None
    norm_w = (torch.rand(k, generator=g) + 0.5).to(dtype).to(device)
    angles = torch.rand(8, head_dim // 2, generator=g) * 6
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1).to(device)
    qk = [(torch.rand(head_dim, generator=g) + 0.5).to(dtype).to(device) for _ in range(2)]
    qk = qk if qk_norm else [None, None]
    results = []
    for fn in (
        reference.rms_norm_linear_rope_store_small_m,
        gemv_mod.rms_norm_linear_rope_store_small_m,
    ):
        caches = [torch.zeros(3, 4, kv_heads, head_dim, dtype=dtype, device=device) for _ in "kv"]
        slot = torch.tensor([7], device=device)
        qkv, total = fn(
            x, residual, norm_w, 1e-6, w, None, torch.tensor([2], device=device), cos_sin,
            *caches, slot, heads, kv_heads, head_dim, *qk, 1e-6,
        )  # fmt: skip
        results.append((qkv, total, *caches))
    for want, got in zip(*results, strict=True):
        torch.testing.assert_close(got, want, **TOL[dtype])
    if with_residual:
        torch.testing.assert_close(residual, kept, atol=0, rtol=0)


def test_linear_rope_store_small_m_checks_qk_norm(gemv_mod, device):
    heads, kv_heads, head_dim, k = 2, 1, 8, 32
    n = (heads + 2 * kv_heads) * head_dim
    x, w, _ = _inputs(n, k, torch.float32, device, bias=False, act=None)
    cos_sin = torch.cat([torch.ones(4, 4), torch.zeros(4, 4)], dim=-1).to(device)  # angle 0
    caches = [torch.zeros(2, 4, kv_heads, head_dim, device=device) for _ in range(2)]
    one = torch.tensor([1], device=device)
    args = (one, cos_sin, *caches, one, heads, kv_heads, head_dim)
    ones = torch.ones(head_dim, device=device)
    got = ops.linear_rope_store_small_m(x, w, None, *args, ones, 2 * ones, 1e-6)
    want = F.linear(x, w)
    q = want[:, : heads * head_dim].view(heads, head_dim)
    torch.testing.assert_close(
        got[:, : heads * head_dim].view(heads, head_dim),
        q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6),
        **TOL[torch.float32],
    )
    with pytest.raises(ValueError, match="give both"):
        ops.linear_rope_store_small_m(x, w, None, *args, ones, None)
    with pytest.raises(ValueError, match=r"must be a contiguous \[8\]"):
        ops.linear_rope_store_small_m(x, w, None, *args, ones, ones[:4])


def test_linear_rope_store_small_m_checks_and_routes(gemv_mod, device):
    heads, kv_heads, head_dim, k = 2, 1, 8, 32
    n = (heads + 2 * kv_heads) * head_dim
    x, w, _ = _inputs(n, k, torch.float32, device, bias=False, act=None)
    cos_sin = torch.cat([torch.ones(4, 4), torch.zeros(4, 4)], dim=-1).to(device)  # angle 0
    caches = [torch.zeros(2, 4, kv_heads, head_dim, device=device) for _ in range(2)]
    one = torch.tensor([1], device=device)
    args = (one, cos_sin, *caches, one, heads, kv_heads, head_dim)
    got = ops.linear_rope_store_small_m(x, w, None, *args)
    want = F.linear(x, w)  # angle 0: rotation is the identity
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    torch.testing.assert_close(caches[0][0, 1, 0], want[0, heads * head_dim : -head_dim])
    torch.testing.assert_close(caches[1][0, 1, 0], want[0, -head_dim:])
    with pytest.raises(ValueError, match="rows, head_dim even"):
        ops.linear_rope_store_small_m(x, w[:-1], None, *args)
    with pytest.raises(ValueError, match="one token each"):
        ops.linear_rope_store_small_m(x, w, None, torch.tensor([1, 2]), *args[1:])
    with pytest.raises(ValueError, match="does not hold"):
        bad = [torch.zeros(2, 4, 2 * kv_heads, head_dim // 2, device=device)] * 2
        ops.linear_rope_store_small_m(
            x, w, None, one, cos_sin, *bad, one, heads, kv_heads, head_dim
        )

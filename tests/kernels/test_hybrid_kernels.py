"""The hybrid-model Triton kernels against their torch references on awkward shapes.

Without a GPU these run under TRITON_INTERPRET=1 on CPU tensors (see conftest.py), in fp32
and fp16, with small shapes; on a GPU the same tests run compiled. Inputs mix prefill rows,
1-token rows, padding rows (slot -1), rows with no tokens and both has_initial_state values.
"""

from __future__ import annotations

import pytest
import torch
from hybrid_cases import conv_case, gdn_case

from atom_kernels import ops, reference

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=3e-3, rtol=3e-3)}
ROWS = dict(
    lens=[1, 6, 2, 0, 1, 3, 1],
    slots=[3, 0, 5, 4, 1, -1, 2],
    resume=[True, False, True, True, False, True, True],
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("width", "with_bias", "activation"), [(4, True, "silu"), (3, False, None)]
)
def test_conv1d_kernel_matches_reference(kernels, device, dtype, width, with_bias, activation):
    case = conv_case(**ROWS, d=37, width=width, seed=21, dtype=dtype, device=device)
    if not with_bias:
        case["bias"] = None
    case["activation"] = activation
    want_state = case["conv_state"].clone()
    want = reference.causal_conv1d_(**{**case, "conv_state": want_state})
    got = kernels["conv1d"].causal_conv1d_(**case)
    torch.testing.assert_close(got, want, **TOL[dtype])
    torch.testing.assert_close(case["conv_state"], want_state, **TOL[dtype])


def test_conv1d_decode_step_with_strided_input(kernels, device):
    # x as a column slice of a wider projection output, every row one token.
    case = conv_case(
        lens=[1] * 5, slots=[0, 2, -1, 1, 4], resume=[True, True, True, False, True], d=20,
        width=4, seed=22, device=device,
    )  # fmt: skip
    wide = torch.randn(5, 31, generator=torch.Generator().manual_seed(1)).to(device)
    wide[:, 3:23] = case["x"]
    case["x"] = wide[:, 3:23]
    want_state = case["conv_state"].clone()
    want = reference.causal_conv1d_(**{**case, "conv_state": want_state})
    torch.testing.assert_close(kernels["conv1d"].causal_conv1d_(**case), want, **TOL[torch.float32])
    torch.testing.assert_close(case["conv_state"], want_state, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("hk", "hv", "dk", "dv"), [(2, 4, 20, 12), (1, 1, 16, 40)])
def test_gdn_recurrent_kernel_matches_reference(kernels, device, dtype, hk, hv, dk, dv):
    case = gdn_case(**ROWS, hk=hk, hv=hv, dk=dk, dv=dv, seed=23, dtype=dtype, device=device)
    want_state = case["state"].clone()
    want = reference.gated_delta_rule_(**{**case, "state": want_state})
    got = kernels["gdn"].gated_delta_rule_recurrent_(**case)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else TOL[dtype]
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(case["state"], want_state, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gdn_chunked_kernel_matches_reference(kernels, device, dtype):
    # Chunks of 16 here (the same code as the 64 of the default, 16x cheaper to interpret):
    # rows of 1, 2, 16 (exactly one chunk), 17 and 40 tokens, a padding row, an empty row.
    case = gdn_case(
        lens=[1, 40, 2, 0, 16, 5, 17], slots=[3, 0, 5, 4, 1, -1, 2],
        resume=[True, False, True, True, False, True, True], hk=1, hv=2, dk=20, dv=12,
        seed=29, dtype=dtype, device=device,
    )  # fmt: skip
    want_state = case["state"].clone()
    want = reference.gated_delta_rule_(**{**case, "state": want_state})
    got = kernels["gdn"].gated_delta_rule_chunked_(**case, chunk=16)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else TOL[dtype]
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(case["state"], want_state, **tol)
    assert torch.count_nonzero(got[59:64]) == 0  # the padding row


def test_gdn_dispatch_sends_prefill_batches_to_the_chunked_kernel(kernels, device, monkeypatch):
    gdn = kernels["gdn"]
    calls = []
    real = gdn.gated_delta_rule_chunked_
    monkeypatch.setattr(gdn, "_fla_chunk", lambda: None)
    monkeypatch.setattr(
        gdn,
        "gated_delta_rule_chunked_",
        lambda *a, **kw: calls.append(1) or real(*a, **kw, chunk=16),
    )
    case = gdn_case(
        lens=[3, 1],
        slots=[0, 1],
        resume=[True, True],
        hk=1,
        hv=1,
        dk=16,
        dv=16,
        seed=30,
        device=device,
    )
    want_state = case["state"].clone()
    want = reference.gated_delta_rule_(**{**case, "state": want_state})
    torch.testing.assert_close(gdn.gated_delta_rule_(**case), want, atol=1e-4, rtol=1e-4)
    decode = gdn_case(
        lens=[1, 1],
        slots=[0, 1],
        resume=[True, True],
        hk=1,
        hv=1,
        dk=16,
        dv=16,
        seed=31,
        device=device,
    )
    gdn.gated_delta_rule_(**decode)
    assert calls == [1]  # the prefill batch only


@pytest.mark.parametrize("choice", ["triton", "fla"])
def test_gdn_prefill_goes_to_fla_only_when_asked(kernels, monkeypatch, choice):
    """fla-core installed is not enough: its per-call host cost makes it the opt-in prefill
    (ATOM_GDN_PREFILL=fla); by default prefill batches run this repository's chunked kernel."""
    gdn = kernels["gdn"]
    calls = []
    monkeypatch.setattr(gdn, "PREFILL_KERNEL", choice)
    monkeypatch.setattr(gdn, "_fla_chunk", lambda: object())  # "installed"
    monkeypatch.setattr(gdn, "gated_delta_rule_chunked_", lambda *a, **kw: calls.append("own"))
    monkeypatch.setattr(gdn, "gated_delta_rule_chunked_fla_", lambda *a, **kw: calls.append("fla"))
    case = gdn_case(lens=[3, 1], slots=[0, 1], resume=[True, True], hk=1, hv=1, dk=16, dv=16,
                    seed=30, device="cpu")  # fmt: skip
    q = case["q"]
    monkeypatch.setattr(type(q), "is_cuda", property(lambda t: True))
    gdn.gated_delta_rule_(**case)
    assert calls == ["own" if choice == "triton" else "fla"]


def test_gdn_recurrent_kernel_decode_batch_bf16_state_free_scale(kernels, device):
    # A decode batch (the CUDA-graph shape), without the L2 norm, another scale.
    case = gdn_case(
        lens=[1] * 4, slots=[2, -1, 0, 3], resume=[True, True, False, True], hk=2, hv=2, dk=8,
        dv=8, seed=24, device=device,
    )  # fmt: skip
    case["q"] *= 0.3
    case["k"] *= 0.3
    case.update(scale=0.5, use_qk_l2norm=False)
    want_state = case["state"].clone()
    want = reference.gated_delta_rule_(**{**case, "state": want_state})
    got = kernels["gdn"].gated_delta_rule_(**case)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(case["state"], want_state, atol=1e-5, rtol=1e-5)
    assert torch.count_nonzero(got[1]) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gated_rms_norm_kernel_matches_reference(kernels, device, dtype):
    g = torch.Generator().manual_seed(25)
    x = torch.randn(19, 48, generator=g).to(dtype).to(device)
    z = torch.randn(19, 48, generator=g).to(dtype).to(device)
    w = torch.randn(48, generator=g).to(dtype).to(device)
    want = reference.gated_rms_norm(x, z, w, 1e-6)
    torch.testing.assert_close(kernels["norm"].gated_rms_norm(x, z, w, 1e-6), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("t", "e", "top_k"), [(5, 4, 2), (40, 3, 3)])
def test_fused_moe_kernel_matches_reference(kernels, device, dtype, t, e, top_k):
    g = torch.Generator().manual_seed(26)
    h, inter = 72, 40  # neither a multiple of the 64-wide tiles
    x = torch.randn(t, h, generator=g).to(dtype).to(device)
    w13 = (torch.randn(e, 2 * inter, h, generator=g) / h**0.5).to(dtype).to(device)
    w2 = (torch.randn(e, h, inter, generator=g) / inter**0.5).to(dtype).to(device)
    weights, ids = reference.moe_topk(torch.randn(t, e, generator=g), top_k, renormalize=True)
    if e > top_k:
        ids[:, 0] = 0  # expert 0 crowded, the last expert maybe empty
    weights, ids = weights.to(device), ids.to(device)
    want = reference.fused_moe(x, w13, w2, weights, ids)
    got = kernels["moe"].fused_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("t", "e", "top_k"), [(1, 6, 3), (3, 4, 2)])
def test_fused_moe_gemv_matches_reference(kernels, device, dtype, t, e, top_k):
    """The pair GEMV path (no sort; blocks of output columns not dividing the sizes, a k loop
    with a ragged end) against the reference, alone and as `fused_moe` takes it for a
    one-token step (the default shapes: on CPU nothing is tuned)."""
    g = torch.Generator().manual_seed(27)
    h, inter = 72, 40
    x = torch.randn(t, h, generator=g).to(dtype).to(device)
    w13 = (torch.randn(e, 2 * inter, h, generator=g) / h**0.5).to(dtype).to(device)
    w2 = (torch.randn(e, h, inter, generator=g) / inter**0.5).to(dtype).to(device)
    weights, ids = reference.moe_topk(torch.randn(t, e, generator=g), top_k, renormalize=True)
    weights, ids = weights.to(device), ids.to(device)
    want = reference.fused_moe(x, w13, w2, weights, ids)
    moe = kernels["moe"]
    got = moe.fused_moe_gemv(x, w13, w2, weights, ids, gate_up=(16, 32, 4), down=(16, 32, 4))
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert moe.launch_shapes(x, w13, w2, top_k) == moe.DEFAULT_LAUNCH and not moe._TUNED
    if t <= moe.GEMV_MAX_TOKENS:
        calls = []
        real = moe.fused_moe_gemv
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(moe, "MOE_GEMV", True)
            mp.setattr(moe, "fused_moe_gemv", lambda *a: calls.append(a) or real(*a))
            torch.testing.assert_close(moe.fused_moe(x, w13, w2, weights, ids), want, **TOL[dtype])
        assert len(calls) == 1


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize(("t", "e", "top_k"), [(1, 6, 3), (7, 40, 8), (3, 5, 5)])
def test_moe_topk_kernel_matches_reference(kernels, device, t, e, top_k, renormalize, shared):
    """Softmax, top k by repeated max, renormalization and the shared expert's column in one
    program per token, against torch's softmax + topk (random logits: no ties)."""
    g = torch.Generator().manual_seed(28)
    logits = (torch.randn(t, e + shared, generator=g) * 3).to(device)
    want_w, want_ids = reference.moe_topk(logits, top_k, renormalize, shared)
    got_w, got_ids = kernels["moe"].moe_topk(logits, top_k, renormalize, shared)
    assert got_ids.dtype == torch.int32 and got_ids.shape == (t, top_k + shared)
    assert torch.equal(got_ids.cpu(), want_ids.cpu())
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)
    if shared:
        assert (got_ids[:, -1] == e).all()


def test_moe_topk_kernel_gives_valid_experts_for_nan_and_inf_rows(kernels, device):
    """A padded row of a captured batch may hold garbage: its experts must still be valid,
    distinct indices (the sort that follows indexes with them), every column written."""
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor(
        [[nan] * 6, [inf, 0.0, inf, 1.0, 0.0, 0.0], [-inf] * 6, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]],
        device=device,
    )
    for shared in (False, True):
        _, ids = kernels["moe"].moe_topk(logits, 3, True, shared)
        routed = ids[:, :3].cpu()
        assert ((routed >= 0) & (routed < 6 - shared)).all(), routed
        assert all(len(set(r.tolist())) == 3 for r in routed)
        assert routed[3].tolist() == ([5, 4, 3] if not shared else [4, 3, 2])


def test_moe_topk_kernel_takes_the_lowest_index_among_equals(kernels, device):
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0]], device=device)
    weights, ids = kernels["moe"].moe_topk(logits.to(torch.float16), 2, True)
    assert ids.tolist() == [[1, 3]]
    torch.testing.assert_close(weights.cpu(), torch.tensor([[0.5, 0.5]]))


def test_sort_pairs_by_expert_groups_and_pads(kernels, device):
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]], dtype=torch.int32, device=device)
    pairs, block_expert = kernels["moe"].sort_pairs_by_expert(ids, num_experts=4, block_m=2)
    pad = 6
    # expert 0: pairs 1, 4; expert 1: pair 3 + pad; expert 2: pairs 0, 2, 5 + pad; 3: none.
    assert pairs.tolist()[:8] == [1, 4, 3, pad, 0, 2, 5, pad]
    assert all(p == pad for p in pairs.tolist()[8:])
    assert block_expert.tolist()[:4] == [0, 1, 2, 2]
    assert all(b == 4 for b in block_expert.tolist()[4:])


def test_ops_dispatch_hybrid_ops_to_triton(kernels, device, monkeypatch):
    """`ops` picks the Triton kernels when forced (or on a GPU) and gives the same results."""
    monkeypatch.setenv("ATOM_KERNEL_BACKEND", "triton")
    ops.refresh_backend()
    try:
        case = gdn_case(
            lens=[2, 1], slots=[0, 1], resume=[True, False], hk=1, hv=2, dk=8, dv=8, seed=27,
            device=device,
        )  # fmt: skip
        want_state = case["state"].clone()
        want = reference.gated_delta_rule_(**{**case, "state": want_state})
        torch.testing.assert_close(ops.gated_delta_rule_(**case), want, atol=1e-4, rtol=1e-4)
        x = torch.randn(3, 8, device=device)
        torch.testing.assert_close(
            ops.gated_rms_norm(x, x, torch.ones(8, device=device), 1e-6),
            reference.gated_rms_norm(x, x, torch.ones(8, device=device), 1e-6),
        )
    finally:
        monkeypatch.delenv("ATOM_KERNEL_BACKEND")
        ops.refresh_backend()


def test_fla_prefill_wrapper_gathers_and_scatters_slot_states(kernels, monkeypatch):
    """The fla-core path's own logic (slot gather, zero initial states where a row does not
    resume, padding rows zeroed, final states back to the real rows' slots) on CPU, with a
    stand-in for fla's `chunk_gated_delta_rule` (which needs a GPU) that follows fla's
    documented varlen contract: q, k `[1, T, H, K]` (H = HV here), initial_state `[N, HV, K,
    V]` fp32, returns (o `[1, T, HV, V]`, final states `[N, HV, K, V]`)."""
    gdn = kernels["gdn"]
    seen = {}

    def fla_chunk(q, k, v, g, beta, *, scale, initial_state, output_final_state,
                  cu_seqlens, use_qk_l2norm_in_kernel):  # fmt: skip
        seen.update(heads=q.shape[2], cu=cu_seqlens.dtype, h0=initial_state.clone())
        assert output_final_state
        o = torch.empty(v.shape, dtype=v.dtype)
        finals = []
        bounds = cu_seqlens.tolist()
        for n in range(len(bounds) - 1):
            lo, hi = bounds[n], bounds[n + 1]
            qs, ks, vs, gs, bs = reference._gdn_inputs(
                q[0, lo:hi], k[0, lo:hi], v[0, lo:hi], g[0, lo:hi], beta[0, lo:hi], scale,
                use_qk_l2norm_in_kernel,
            )  # fmt: skip
            out, s = reference.gdn_chunked(qs, ks, vs, gs, bs, initial_state[n])
            o[0, lo:hi] = out.transpose(0, 1).to(o.dtype)
            finals.append(s)
        return o, torch.stack(finals)

    monkeypatch.setattr(gdn, "_fla_chunk", lambda: fla_chunk)
    case = gdn_case(
        lens=[7, 1, 3, 0, 5], slots=[2, 0, -1, 4, 1], resume=[True, False, True, True, False],
        hk=1, hv=2, dk=8, dv=4, seed=28,
    )  # fmt: skip
    want_state = case["state"].clone()
    want = reference.gated_delta_rule_(**{**case, "state": want_state})
    got = gdn.gated_delta_rule_chunked_fla_(**case)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(case["state"], want_state, atol=1e-5, rtol=1e-5)
    assert seen["heads"] == 2 and seen["cu"] == torch.int64
    assert torch.count_nonzero(seen["h0"][[1, 2, 4]]) == 0  # fresh, padding, fresh rows

"""GPT-OSS's experts in the fused MoE kernels: per-expert biases on gate/up and down, and the
clamped SwiGLU, on the sorted grouped-GEMM path and on the pair GEMV, against the reference
(which pins transformers' arithmetic: gate clamped above, up both sides, `(up + 1) * gate *
sigmoid(alpha * gate)`, the down bias scaled by the routing weight)."""

from __future__ import annotations

import pytest
import torch

from atom_kernels import reference

# fp16: the intermediate row is rounded to fp16 between the two GEMMs, outputs reach ~10.
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=2e-2, rtol=1e-2)}


def _case(t: int, e: int, top_k: int, dtype, device, seed: int):
    g = torch.Generator().manual_seed(seed)
    h, inter = 72, 40  # neither a multiple of the 64-wide tiles
    x = (torch.randn(t, h, generator=g) * 4).to(dtype).to(device)  # some gates past the clamp
    w13 = (torch.randn(e, 2 * inter, h, generator=g) / h**0.5).to(dtype).to(device)
    w2 = (torch.randn(e, h, inter, generator=g) / inter**0.5).to(dtype).to(device)
    b13 = torch.randn(e, 2 * inter, generator=g).to(dtype).to(device)
    b2 = torch.randn(e, h, generator=g).to(dtype).to(device)
    weights, ids = reference.moe_topk(torch.randn(t, e, generator=g), top_k, renormalize=True)
    return x, w13, w2, weights.to(device), ids.to(device), b13, b2


def test_reference_is_transformers_arithmetic():
    x, w13, w2, weights, ids, b13, b2 = _case(6, 4, 2, torch.float32, "cpu", 30)
    inter = w2.shape[2]
    want = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = w13[e] @ x[t] + b13[e]
            gate, up = gu[:inter].clamp(max=7.0), gu[inter:].clamp(-7.0, 7.0)
            act = (up + 1) * gate * torch.sigmoid(gate * 1.702)
            want[t] += weights[t, j] * (w2[e] @ act + b2[e])
    got = reference.fused_moe(x, w13, w2, weights, ids, b13, b2, "swiglu_clamped", 1.702, 7.0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    plain = reference.fused_moe(x, w13, w2, weights, ids)
    assert not torch.allclose(plain, got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("t", "gemv"), [(1, True), (3, True), (40, False)])
def test_fused_moe_with_biases_and_clamp_matches_reference(kernels, device, dtype, t, gemv):
    x, w13, w2, weights, ids, b13, b2 = _case(t, 5, 2, dtype, device, 31)
    extra = (b13, b2, "swiglu_clamped", 1.702, 7.0)
    want = reference.fused_moe(x, w13, w2, weights, ids, *extra)
    moe = kernels["moe"]
    if gemv:
        arith = moe.ExpertArith(b13, b2, True, 1.702, 7.0)
        got = moe.fused_moe_gemv(
            x, w13, w2, weights, ids, gate_up=(16, 32, 4), down=(16, 32, 4), arith=arith
        )
    else:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(moe, "MOE_GEMV", False)
            got = moe.fused_moe(x, w13, w2, weights, ids, *extra)
    torch.testing.assert_close(got, want, **TOL[dtype])
    # The down bias only (a rank > 0 under tensor parallelism passes none).
    half = reference.fused_moe(x, w13, w2, weights, ids, b13, None, "swiglu_clamped")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(moe, "MOE_GEMV", gemv)
        got = moe.fused_moe(x, w13, w2, weights, ids, b13, None, "swiglu_clamped")
    torch.testing.assert_close(got, half, **TOL[dtype])

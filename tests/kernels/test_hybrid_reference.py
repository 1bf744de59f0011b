"""The hybrid-model ops' torch references (and `ops` dispatch on CPU) against independent
specifications: a plain token-by-token recurrence for Gated DeltaNet and the conv1d, naive
per-token loops for the MoE, and transformers' public gated RMSNorm module in fp32.

transformers' own GDN and conv1d functions are module internals that change between releases
(5.25 wrapped them in hub-kernel objects), so they are not called here: the whole-model tests in
tests/runtime/models/test_hybrid.py compare every op, inside the model, with transformers' public
`AutoModelForCausalLM` in fp32."""

from __future__ import annotations

import pytest
import torch
from hybrid_cases import (
    conv_case,
    gdn_case,
    naive_conv1d,
    naive_gdn,
    naive_moe,
    naive_topk,
)

from atom_kernels import ops, reference

FP32 = dict(atol=2e-5, rtol=2e-5)


@pytest.fixture(autouse=True)
def _torch_backend(monkeypatch):
    monkeypatch.setenv("ATOM_KERNEL_BACKEND", "torch")
    ops.refresh_backend()
    yield
    monkeypatch.delenv("ATOM_KERNEL_BACKEND")
    ops.refresh_backend()


# ----- causal conv1d ----------------------------------------------------------------------------


@pytest.mark.parametrize("width", [4, 2])
@pytest.mark.parametrize("with_bias", [True, False])
def test_conv1d_reference_equals_token_loop(width, with_bias):
    case = conv_case(
        lens=[1, 9, 2, 0, 1, 5, 1], slots=[3, 0, 5, -1, 1, -1, 2],
        resume=[True, False, True, True, False, True, True], d=19, width=width, seed=1,
    )  # fmt: skip
    if not with_bias:
        case["bias"] = None
    want_state = case["conv_state"].clone()
    want = naive_conv1d(**{**case, "conv_state": want_state})
    got = ops.causal_conv1d_(**case)
    torch.testing.assert_close(got, want, **FP32)
    torch.testing.assert_close(case["conv_state"], want_state, **FP32)
    # Padding rows give zero outputs; slots no real row names are not touched.
    assert torch.count_nonzero(got[13:18]) == 0
    assert torch.equal(case["conv_state"][4], want_state[4])


def test_conv1d_short_sequence_keeps_part_of_the_old_state():
    # W-1 = 3; a 1-token row keeps the two newest old inputs, then the new one.
    case = conv_case(lens=[1], slots=[0], resume=[True], d=3, width=4, seed=2)
    old = case["conv_state"][0].clone()
    ops.causal_conv1d_(**case)
    assert torch.equal(case["conv_state"][0][:, :2], old[:, 1:])
    assert torch.equal(case["conv_state"][0][:, 2], case["x"][0])


# ----- gated delta rule -------------------------------------------------------------------------

GDN_LAYOUTS = [
    # (lens, slots, resume): prefill rows past one chunk, 1-token decode rows, padding rows
    pytest.param(
        [70, 1, 3, 1, 130], [2, 0, -1, 4, 1], [False, True, True, False, True], id="mixed"
    ),
    pytest.param([1, 1, 1], [1, -1, 3], [True, True, True], id="decode-only"),
    pytest.param([64, 65], [0, 2], [True, False], id="chunk-borders"),
]


@pytest.mark.parametrize(("lens", "slots", "resume"), GDN_LAYOUTS)
@pytest.mark.parametrize(("hk", "hv"), [(2, 4), (3, 3)])
def test_gdn_reference_equals_token_recurrence(lens, slots, resume, hk, hv):
    case = gdn_case(lens=lens, slots=slots, resume=resume, hk=hk, hv=hv, dk=20, dv=12, seed=4)
    want_state = case["state"].clone()
    want = naive_gdn(**{**case, "state": want_state})
    got = ops.gated_delta_rule_(**case)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(case["state"], want_state, atol=1e-4, rtol=1e-4)
    for b, slot in enumerate(slots):
        if slot < 0:
            lo, hi = sum(lens[:b]), sum(lens[: b + 1])
            assert torch.count_nonzero(got[lo:hi]) == 0


def test_gdn_without_initial_state_ignores_what_the_slot_holds():
    case = gdn_case(
        lens=[5, 1], slots=[0, 1], resume=[False, False], hk=1, hv=2, dk=8, dv=8, seed=5
    )
    got = ops.gated_delta_rule_(**case)
    case2 = {**case, "state": torch.zeros_like(case["state"])}
    torch.testing.assert_close(got, ops.gated_delta_rule_(**case2), **FP32)
    torch.testing.assert_close(case["state"][:2], case2["state"][:2], **FP32)


def test_gdn_without_l2norm_and_with_other_scale():
    case = gdn_case(lens=[3, 1], slots=[0, 1], resume=[True, True], hk=1, hv=1, dk=6, dv=5, seed=6)
    case["q"] *= 0.3
    case["k"] *= 0.3  # unnormalised keys must stay small for the recurrence to stay bounded
    case.update(scale=0.7, use_qk_l2norm=False)
    want_state = case["state"].clone()
    want = naive_gdn(**{**case, "state": want_state})
    torch.testing.assert_close(ops.gated_delta_rule_(**case), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(case["state"], want_state, atol=1e-4, rtol=1e-4)


# ----- gated RMSNorm, MoE -----------------------------------------------------------------------


def test_gated_rms_norm_matches_transformers():
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

    g = torch.Generator().manual_seed(8)
    x, z = torch.randn(11, 40, generator=g), torch.randn(11, 40, generator=g)
    norm = Qwen3NextRMSNormGated(40, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(40, generator=g))
        want = norm(x, z)
    torch.testing.assert_close(ops.gated_rms_norm(x, z, norm.weight.detach(), 1e-6), want, **FP32)


@pytest.mark.parametrize("renormalize", [True, False])
def test_moe_topk_equals_naive(renormalize):
    logits = torch.randn(9, 7, generator=torch.Generator().manual_seed(9))
    w, ids = ops.moe_topk(logits, 3, renormalize)
    want_w, want_ids = naive_topk(logits, 3, renormalize)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(w, want_w, **FP32)


def test_fused_moe_reference_equals_token_loop():
    g = torch.Generator().manual_seed(10)
    t, h, inter, e, top_k = 13, 24, 20, 6, 2
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * inter, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, inter, generator=g) / inter**0.5
    w, ids = ops.moe_topk(torch.randn(t, e, generator=g), top_k, True)
    ids[:, 0] = 5  # one expert gets every token, others few or none
    ids[:, 1] = torch.where(ids[:, 1] == 5, 0, ids[:, 1])
    got = ops.fused_moe(x, w13, w2, w, ids)
    torch.testing.assert_close(got, naive_moe(x, w13, w2, w, ids), **FP32)


# ----- boundary validation ----------------------------------------------------------------------


def test_hybrid_ops_name_the_bad_argument():
    case = gdn_case(lens=[2], slots=[0], resume=[True], hk=1, hv=2, dk=4, dv=4, seed=11)
    with pytest.raises(ValueError, match="slot_ids"):
        ops.gated_delta_rule_(**{**case, "slot_ids": case["slot_ids"].long()})
    with pytest.raises(ValueError, match="has_initial_state"):
        ops.gated_delta_rule_(**{**case, "has_initial_state": torch.ones(1, dtype=torch.int32)})
    with pytest.raises(ValueError, match="query_start_loc"):
        ops.gated_delta_rule_(**{**case, "query_start_loc": case["query_start_loc"].long()})
    with pytest.raises(ValueError, match="g must be fp32"):
        ops.gated_delta_rule_(**{**case, "g": case["g"].half()})
    with pytest.raises(ValueError, match="state must be"):
        ops.gated_delta_rule_(**{**case, "state": case["state"][:, :1]})
    with pytest.raises(ValueError, match="v must be"):
        ops.gated_delta_rule_(**{**case, "v": torch.zeros(3, 2, 4)})
    conv = conv_case(lens=[2], slots=[0], resume=[True], d=5, width=4, seed=12)
    with pytest.raises(ValueError, match="conv_state"):
        ops.causal_conv1d_(**{**conv, "conv_state": torch.zeros(2, 5, 4)})
    with pytest.raises(ValueError, match="activation"):
        ops.causal_conv1d_(**{**conv, "activation": "gelu"})
    x = torch.zeros(3, 8)
    with pytest.raises(ValueError, match="z must"):
        ops.gated_rms_norm(x, torch.zeros(3, 4), torch.ones(8), 1e-6)
    w13, w2 = torch.zeros(4, 6, 8), torch.zeros(4, 8, 3)
    ids, w = torch.zeros(3, 2, dtype=torch.int32), torch.zeros(3, 2)
    with pytest.raises(ValueError, match="w2 must"):
        ops.fused_moe(x, w13, torch.zeros(4, 8, 4), w, ids)
    with pytest.raises(ValueError, match="topk_ids"):
        ops.fused_moe(x, w13, w2, w, ids.long())
    with pytest.raises(ValueError, match="topk_weights"):
        ops.fused_moe(x, w13, w2, w.half(), ids)
    with pytest.raises(ValueError, match="top_k"):
        ops.moe_topk(torch.zeros(3, 4), 5, True)


def test_reference_chunked_gdn_equals_recurrent_steps_on_one_head_batch():
    """The chunk size does not change the result: chunk 64 vs chunk 8 vs token steps."""
    g = torch.Generator().manual_seed(13)
    h, length, dk, dv = 3, 50, 8, 6
    q = reference.l2_normalize(torch.randn(h, length, dk, generator=g)) * dk**-0.5
    k = reference.l2_normalize(torch.randn(h, length, dk, generator=g))
    v = torch.randn(h, length, dv, generator=g)
    gl = -torch.rand(h, length, generator=g)
    beta = torch.rand(h, length, generator=g)
    s0 = torch.randn(h, dk, dv, generator=g)
    o64, s64 = reference.gdn_chunked(q, k, v, gl, beta, s0)
    o8, s8 = reference.gdn_chunked(q, k, v, gl, beta, s0, chunk=8)
    state, outs = s0, []
    for i in range(length):
        o, state = reference.gdn_recurrent_step(
            q[:, i], k[:, i], v[:, i], gl[:, i], beta[:, i], state
        )
        outs.append(o)
    torch.testing.assert_close(o64, torch.stack(outs, 1), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(o8, o64, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s64, state, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s8, state, atol=1e-4, rtol=1e-4)

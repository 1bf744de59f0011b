"""Compiled hybrid-model kernels on a GPU: bf16, Qwen3-Next-sized shapes, the dispatch through
`ops` (fla-core's chunked prefill when it is installed), decode steps captured in a CUDA graph
and replayed with other slots, and the fused decode ops (GDN layer in one launch, gated
attention's prep and output gate) at Qwen3.5-4B sizes. Skipped (with a reason, by
tests/conftest.py) without a GPU.

    python3 -m pytest -q tests/kernels/test_hybrid_kernels_gpu.py
"""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch
from hybrid_cases import conv_case, gdn_case, gdn_decode_case, unfused_gdn_decode
from hybrid_cases import run_on_state_copies as _states_run

from atom_kernels import ops, reference

pytestmark = pytest.mark.gpu

BF16 = dict(atol=2e-2, rtol=2e-2)
HAS_FLA = importlib.util.find_spec("fla") is not None


def _lens(seed: int, n: int, longest: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, longest, (n,), generator=g).tolist()
    lens[1] = 1
    lens[2] = longest + 77  # past several 64-token chunks
    return lens


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_conv1d_prefill_and_decode_qwen3_next_width(kernels, dtype):
    lens = _lens(30, 12, 700)
    slots = list(range(12))
    slots[4] = -1
    resume = [i % 3 != 0 for i in range(12)]
    case = conv_case(
        lens=lens, slots=slots, resume=resume, d=8192, width=4, seed=31, num_slots=16,
        dtype=dtype, device="cuda",
    )  # fmt: skip
    want_state = case["conv_state"].clone()
    want = reference.causal_conv1d_(**{**case, "conv_state": want_state})
    got = ops.causal_conv1d_(**case)
    tol = BF16 if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(case["conv_state"], want_state, **tol)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_gdn_decode_batch(kernels, state_dtype):
    b = 64
    slots = torch.randperm(96, generator=torch.Generator().manual_seed(32))[:b].tolist()
    slots[5] = -1
    case = gdn_case(
        lens=[1] * b, slots=slots, resume=[i % 7 != 0 for i in range(b)], hk=16, hv=32,
        dk=128, dv=128, seed=33, num_slots=96, dtype=torch.bfloat16, state_dtype=state_dtype,
        device="cuda",
    )  # fmt: skip
    want_state = case["state"].clone()
    want = reference.gated_delta_rule_(**{**case, "state": want_state})
    got = ops.gated_delta_rule_(**case)
    torch.testing.assert_close(got, want, **BF16)
    torch.testing.assert_close(case["state"], want_state, **BF16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gdn_prefill_varlen(kernels, dtype):
    """Whatever path ops takes for a prefill batch (fla-core's chunks when installed, this
    repository's chunked kernel otherwise), it equals the chunked torch reference."""
    lens = _lens(34, 6, 400)
    slots = [3, 0, 5, -1, 1, 2]
    case = gdn_case(
        lens=lens, slots=slots, resume=[True, False, True, True, False, True], hk=4, hv=8,
        dk=128, dv=128, seed=35, num_slots=8, dtype=dtype, device="cuda",
    )  # fmt: skip
    want_state = case["state"].clone()
    want = reference.gated_delta_rule_(**{**case, "state": want_state})
    got = ops.gated_delta_rule_(**case)
    tol = BF16 if dtype == torch.bfloat16 else dict(atol=5e-3, rtol=5e-3)  # fla: tf32 dots
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(case["state"], want_state, **tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gdn_own_chunked_kernel_qwen3_next_heads(kernels, dtype):
    """This repository's chunked prefill kernel (what runs when fla-core is absent) at
    Qwen3-Next's head sizes: 16 k heads, 32 v heads of 128."""
    case = gdn_case(
        lens=[1000, 1, 64, 257], slots=[0, 1, -1, 3], resume=[True, True, False, False], hk=16,
        hv=32, dk=128, dv=128, seed=39, num_slots=4, dtype=dtype, device="cuda",
    )  # fmt: skip
    want_state = case["state"].clone()
    want = reference.gated_delta_rule_(**{**case, "state": want_state})
    got = kernels["gdn"].gated_delta_rule_chunked_(**case)
    tol = BF16 if dtype == torch.bfloat16 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(case["state"], want_state, **tol)


@pytest.mark.skipif(not HAS_FLA, reason="fla-core is not installed")
def test_gdn_fla_path_equals_recurrent_kernel(kernels):
    gdn = kernels["gdn"]
    case = gdn_case(
        lens=[300, 1, 129, 64], slots=[0, 1, -1, 3], resume=[True, True, False, False], hk=2,
        hv=4, dk=128, dv=128, seed=36, num_slots=4, dtype=torch.bfloat16, device="cuda",
    )  # fmt: skip
    state2 = case["state"].clone()
    got = gdn.gated_delta_rule_chunked_fla_(**case)
    want = gdn.gated_delta_rule_recurrent_(**{**case, "state": state2})
    torch.testing.assert_close(got, want, **BF16)
    torch.testing.assert_close(case["state"], state2, **BF16)


def _moe_case(t, e, top_k, h, inter, seed):
    """bf16 tokens, experts (gate/up rows then down) and a top-k routing of them, on the GPU."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16).cuda()
    w13 = (torch.randn(e, 2 * inter, h, generator=g) / h**0.5).to(torch.bfloat16).cuda()
    w2 = (torch.randn(e, h, inter, generator=g) / inter**0.5).to(torch.bfloat16).cuda()
    weights, ids = ops.moe_topk(torch.randn(t, e, generator=g).cuda(), top_k, renormalize=True)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize(
    ("t", "e", "top_k", "h", "inter"), [(3, 64, 8, 2048, 512), (1000, 16, 2, 1024, 768)]
)
def test_fused_moe_bf16(kernels, t, e, top_k, h, inter):
    case = _moe_case(t, e, top_k, h, inter, seed=37)
    torch.testing.assert_close(ops.fused_moe(*case), reference.fused_moe(*case), **BF16)


@pytest.mark.parametrize(
    ("t", "e", "top_k", "h", "inter"), [(1, 64, 8, 2048, 512), (1, 16, 2, 1024, 768)]
)
def test_fused_moe_gemv_bf16(kernels, t, e, top_k, h, inter):
    """The one-token pair GEMV path (ATOM_MOE_GEMV=1) at Qwen3.5-35B-A3B's expert sizes."""
    from atom_kernels import moe

    case = _moe_case(t, e, top_k, h, inter, seed=38)
    torch.testing.assert_close(moe.fused_moe_gemv(*case), reference.fused_moe(*case), **BF16)


@pytest.mark.parametrize(("t", "e", "top_k"), [(1, 256, 8), (300, 512, 10), (7, 128, 8)])
@pytest.mark.parametrize("shared", [False, True])
def test_moe_topk_on_the_gpu(kernels, t, e, top_k, shared):
    """The router kernel: fp32 logits (no ties) give torch's experts and weights; bf16 logits
    as the router GEMV leaves them (ties likely among 256) give the same top-k probabilities."""
    from atom_kernels import moe

    g = torch.Generator().manual_seed(39)
    logits = (torch.randn(t, e + shared, generator=g) * 2).cuda()
    want_w, want_ids = reference.moe_topk(logits, top_k, True, shared)
    got_w, got_ids = moe.moe_topk(logits, top_k, True, shared)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)
    low = logits.to(torch.bfloat16)
    want_w, _ = reference.moe_topk(low, top_k, True, shared)
    got_w, got_ids = moe.moe_topk(low, top_k, True, shared)
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)
    routed = got_ids[:, :top_k].long()
    assert (routed.sort(1).values.diff(dim=1) > 0).all()  # distinct experts per token


@pytest.mark.parametrize("t", [1, 5])
def test_fused_moe_with_a_stacked_shared_expert_bf16(kernels, t):
    """Qwen3.5-35B-A3B's layer: 256 experts + the shared expert stacked as expert 256, routed
    by `moe_topk(shared_expert=True)`, against the reference's routed sum plus the shared
    expert's DenseMLP-style output scaled by its gate, on both MoE paths."""
    from atom_kernels import moe

    e, top_k, h, inter = 256, 8, 2048, 512
    g = torch.Generator().manual_seed(40)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16).cuda()
    w13 = (torch.randn(e + 1, 2 * inter, h, generator=g) / h**0.5).to(torch.bfloat16).cuda()
    w2 = (torch.randn(e + 1, h, inter, generator=g) / inter**0.5).to(torch.bfloat16).cuda()
    logits = torch.randn(t, e + 1, generator=g).to(torch.bfloat16).cuda()
    weights, ids = moe.moe_topk(logits, top_k, True, True)
    routed = reference.fused_moe(x, w13[:e], w2[:e], weights[:, :top_k], ids[:, :top_k])
    xf = x.float()
    gate, up = (xf @ w13[e].float().T).chunk(2, dim=-1)
    shared = (torch.nn.functional.silu(gate) * up) @ w2[e].float().T
    want = routed.float() + torch.sigmoid(logits[:, -1:].float()) * shared
    tol = {"rtol": 3e-2, "atol": 3e-2}
    torch.testing.assert_close(moe.fused_moe(x, w13, w2, weights, ids).float(), want, **tol)
    if t == 1:
        torch.testing.assert_close(
            moe.fused_moe_gemv(x, w13, w2, weights, ids).float(), want, **tol
        )


def test_gated_rms_norm_bf16(kernels):
    g = torch.Generator().manual_seed(38)
    x = torch.randn(4096, 128, generator=g).to(torch.bfloat16).cuda()
    z = torch.randn(4096, 128, generator=g).to(torch.bfloat16).cuda()
    w = torch.randn(128, generator=g).to(torch.bfloat16).cuda()
    want = reference.gated_rms_norm(x, z, w, 1e-6)
    torch.testing.assert_close(ops.gated_rms_norm(x, z, w, 1e-6), want, **BF16)


def test_decode_step_replays_in_a_cuda_graph_with_new_slots(kernels):
    """conv1d + GDN + MoE decode launches need no host sync: captured once, replayed with other
    slot ids and inputs written into the same buffers, they match the references."""
    b, d, hk, hv, dk, dv, e, h, inter = 8, 256, 2, 4, 64, 64, 8, 128, 64
    dev = "cuda"
    conv = conv_case(
        lens=[1] * b, slots=list(range(b)), resume=[True] * b, d=d, width=4, seed=40,
        num_slots=16, dtype=torch.bfloat16, device=dev,
    )  # fmt: skip
    gdn = gdn_case(
        lens=[1] * b, slots=list(range(b)), resume=[True] * b, hk=hk, hv=hv, dk=dk, dv=dv,
        seed=41, num_slots=16, dtype=torch.bfloat16, device=dev,
    )  # fmt: skip
    gdn["query_start_loc"], gdn["slot_ids"] = conv["query_start_loc"], conv["slot_ids"]
    gdn["has_initial_state"] = conv["has_initial_state"]
    gen = torch.Generator().manual_seed(42)
    mx = torch.randn(b, h, generator=gen).to(torch.bfloat16).to(dev)
    w13 = (torch.randn(e, 2 * inter, h, generator=gen) / h**0.5).to(torch.bfloat16).to(dev)
    w2 = (torch.randn(e, h, inter, generator=gen) / inter**0.5).to(torch.bfloat16).to(dev)
    tw, tid = ops.moe_topk(torch.randn(b, e, generator=gen).to(dev), 2, True)

    def step():
        return (
            ops.causal_conv1d_(**conv),
            ops.gated_delta_rule_(**gdn),
            ops.fused_moe(mx, w13, w2, tw, tid),
        )

    conv_state0, gdn_state0 = conv["conv_state"].clone(), gdn["state"].clone()
    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    # New inputs: other slots (one padding row), fresh tokens, other experts.
    conv["slot_ids"].copy_(torch.tensor([9, 3, -1, 12, 0, 15, 7, 2], dtype=torch.int32))
    conv["conv_state"].copy_(conv_state0)
    gdn["state"].copy_(gdn_state0)
    for t in (conv["x"], gdn["q"], gdn["k"], gdn["v"], mx):
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    tid.copy_(torch.randint(0, e, tid.shape, generator=gen).to(torch.int32))
    conv_want_state, gdn_want_state = conv_state0.clone(), gdn_state0.clone()
    want = (
        reference.causal_conv1d_(**{**conv, "conv_state": conv_want_state}),
        reference.gated_delta_rule_(**{**gdn, "state": gdn_want_state}),
        reference.fused_moe(mx, w13, w2, tw, tid),
    )
    graph.replay()
    torch.cuda.synchronize()
    for got, ref in zip(outs, want, strict=True):
        torch.testing.assert_close(got, ref, **BF16)
    torch.testing.assert_close(conv["conv_state"], conv_want_state, **BF16)
    torch.testing.assert_close(gdn["state"], gdn_want_state, **BF16)


def test_state_copy_large_units_and_graph_replay_with_a_new_table(kernels):
    """State-checkpoint byte copy: 1 MiB-class units between a slot pool and a page pool,
    captured in a CUDA graph with its table on the device, replayed after the table changed."""
    from atom_kernels.copy_table import state_copy_table

    unit = 64 * 1024 + 16  # words of 8 bytes, a tail past the 2048-word block
    pages = torch.randint(0, 256, (40 * unit,), dtype=torch.uint8, device="cuda")
    slots = torch.randint(0, 256, (8 * unit,), dtype=torch.uint8, device="cuda")
    sizes = [pages.numel(), slots.numel()]
    first = state_copy_table(
        [(1, 0, unit, 0, 3 * unit, 5 * unit, 4), (0, 30 * unit, unit, 1, 6 * unit, unit, 2)],
        sizes, unit,
    ).cuda()  # fmt: skip
    second = state_copy_table(
        [(1, 2 * unit, unit, 0, 0, unit, 3), (0, 20 * unit, -unit, 1, 5 * unit, unit, 3)],
        sizes, unit,
    ).cuda()  # fmt: skip
    table = first.clone()
    ops.state_copy_([pages, slots], table, unit, 8)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.state_copy_([pages, slots], table, unit, 8)
    table.copy_(second)
    want = [pages.clone(), slots.clone()]
    reference.state_copy_(want, second, unit, 8)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(pages, want[0]) and torch.equal(slots, want[1])


def _fused_decode_case(b: int, seed: int, state_dtype=torch.float32, num_slots: int = 96):
    """Qwen3.5-4B's GDN layer (16 k heads, 32 v heads of 128, conv width 4), one token per row,
    bf16 projection; rows 0 mod 7 start fresh, row 5 (when there is one) is padding."""
    slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(seed))[:b].tolist()
    if b > 5:
        slots[5] = -1
    return gdn_decode_case(
        slots=slots, resume=[i % 7 != 0 for i in range(b)], hk=16, hv=32, dk=128, dv=128,
        seed=seed + 1, num_slots=num_slots, dtype=torch.bfloat16, state_dtype=state_dtype,
        device="cuda",
    )  # fmt: skip


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b", [1, 64])
def test_gdn_fused_decode_qwen3_5_4b(kernels, b, state_dtype):
    """The fused op against its reference and against the unfused chain of Triton kernels it
    replaces (conv1d, gates, recurrent GDN, gated norm), outputs and both states."""
    case = _fused_decode_case(b, seed=60, state_dtype=state_dtype)
    got = _states_run(ops.gated_delta_net_decode_, case)
    want = _states_run(reference.gated_delta_net_decode_, case)
    chain = _states_run(lambda **c: unfused_gdn_decode(**c, ops=ops), case)
    for g, w, c in zip(got, want, chain, strict=True):
        torch.testing.assert_close(g, w, **BF16)
        torch.testing.assert_close(g, c, **BF16)
    if b > 5:
        assert torch.count_nonzero(got[0][5]) == 0


@pytest.mark.parametrize("b", [8, 64])
def test_gdn_fused_decode_replays_in_a_cuda_graph_with_new_slots(kernels, b):
    """Captured once, replayed after the slot ids, has_initial_state and the projection rows were
    rewritten in place: no host sync, a grid from shapes, the states of the new slots. 8 rows
    run gdn_decode.py's split kernel, 64 the wide one (on an H200)."""
    case = _fused_decode_case(b, seed=61)
    conv0, ssm0 = case["conv_state"].clone(), case["ssm_state"].clone()
    ops.gated_delta_net_decode_(**case)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.gated_delta_net_decode_(**case)
    gen = torch.Generator().manual_seed(62)
    slots = torch.randperm(96, generator=gen)[:b].to(torch.int32)
    slots[[2, b - 3]] = -1
    case["slot_ids"].copy_(slots)
    case["has_initial_state"].copy_(torch.rand(b, generator=gen) > 0.3)
    case["proj"].copy_(torch.randn(case["proj"].shape, generator=gen).to(torch.bfloat16))
    case["conv_state"].copy_(conv0)
    case["ssm_state"].copy_(ssm0)
    want = _states_run(reference.gated_delta_net_decode_, case)
    graph.replay()
    torch.cuda.synchronize()
    for g, w in zip((out, case["conv_state"], case["ssm_state"]), want, strict=True):
        torch.testing.assert_close(g, w, **BF16)
    assert torch.count_nonzero(out[[2, b - 3]]) == 0
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert kernels["gdn_decode_wide"].takes_wide_path(b, 16, sms) == (b * 16 > 2 * sms)


def test_gdn_gating_bf16(kernels):
    g = torch.Generator().manual_seed(63)
    wide = (torch.randn(1000, 70, generator=g) * 8).to(torch.bfloat16).cuda()
    a, b = wide[:, :32], wide[:, 35:67]
    a_log = torch.randn(32, generator=g).to(torch.bfloat16).cuda()
    dt_bias = torch.randn(32, generator=g).to(torch.bfloat16).cuda()
    got = ops.gdn_gating(a, b, a_log, dt_bias)
    want = reference.gdn_gating(a, b, a_log, dt_bias)
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tokens", [1, 300])
def test_gated_attention_prep_and_gate_qwen3_5_4b(kernels, tokens):
    """16 q heads with their gates, 4 KV heads of 256, rotary on the first 64 channels, bf16:
    the fused prep and the output gate against their references."""
    g = torch.Generator().manual_seed(64)
    h, kvh, d, rot = 16, 4, 256, 64
    qkv = torch.randn(tokens, (2 * h + 2 * kvh) * d, generator=g).to(torch.bfloat16).cuda()
    positions = torch.randint(0, 4096, (tokens,), generator=g).cuda()
    slots = torch.randperm(40 * 16, generator=g)[:tokens].cuda()
    inv = 1.0 / (1e7 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    freqs = torch.outer(torch.arange(4096, dtype=torch.float32), inv)
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1).cuda()
    qw = (torch.rand(d, generator=g) + 0.5).to(torch.bfloat16).cuda()
    kw = (torch.rand(d, generator=g) + 0.5).to(torch.bfloat16).cuda()
    k_cache = torch.zeros(40, 16, kvh, d, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    want_qkv, want_k, want_v = qkv.clone(), k_cache.clone(), v_cache.clone()
    reference.qk_norm_rope_store_(
        want_qkv, positions, cache, qw, kw, 1e-6, want_k, want_v, slots, h, kvh, d, True
    )
    ops.qk_norm_rope_store_(
        qkv, positions, cache, qw, kw, 1e-6, k_cache, v_cache, slots, h, kvh, d, True
    )
    torch.testing.assert_close(qkv, want_qkv, **BF16)
    torch.testing.assert_close(k_cache, want_k, **BF16)
    torch.testing.assert_close(v_cache, want_v, **BF16)
    attn = torch.randn(tokens, h, d, generator=g).to(torch.bfloat16).cuda()
    gate = qkv[:, : 2 * h * d].view(tokens, h, 2 * d)[..., d:]
    torch.testing.assert_close(
        ops.sigmoid_gate_mul(attn, gate), reference.sigmoid_gate_mul(attn, gate), **BF16
    )


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b", [37, 256])
def test_gdn_wide_decode_qwen3_5_4b_every_launch_shape(kernels, b, state_dtype):
    """The wide kernel at each launch candidate (and the rule) against the reference and
    against gdn_decode.py's kernel, outputs and both states, at a batch that fills the GPU and
    one that is not a power of two."""
    wide = kernels["gdn_decode_wide"]
    case = _fused_decode_case(b, seed=65, state_dtype=state_dtype, num_slots=300)
    want = _states_run(reference.gated_delta_net_decode_, case)
    split = _states_run(
        lambda **c: kernels["gdn_decode"].gated_delta_net_decode_(**c, v_split=1), case
    )
    for config in wide.launch_candidates(128, 128):
        knobs = {k: v for k, v in config.items() if k != "kernel"}
        got = _states_run(functools.partial(wide.gated_delta_net_decode_wide_, **knobs), case)
        for g, w, s in zip(got, want, split, strict=True):
            torch.testing.assert_close(g, w, **BF16)
            torch.testing.assert_close(g, s, **BF16)
        assert torch.count_nonzero(got[0][5]) == 0

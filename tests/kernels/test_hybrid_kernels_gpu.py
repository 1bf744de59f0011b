"""Compiled hybrid-model kernels on a GPU: bf16, Qwen3-Next-sized shapes, the dispatch through
`ops` (fla-core's chunked prefill when it is installed), and decode steps captured in a CUDA
graph and replayed with other slots. Skipped (with a reason, by tests/conftest.py) without a GPU.

    python3 -m pytest -q tests/kernels/test_hybrid_kernels_gpu.py
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from hybrid_cases import conv_case, gdn_case

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


@pytest.mark.parametrize(
    ("t", "e", "top_k", "h", "inter"), [(3, 64, 8, 2048, 512), (1000, 16, 2, 1024, 768)]
)
def test_fused_moe_bf16(kernels, t, e, top_k, h, inter):
    g = torch.Generator().manual_seed(37)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16).cuda()
    w13 = (torch.randn(e, 2 * inter, h, generator=g) / h**0.5).to(torch.bfloat16).cuda()
    w2 = (torch.randn(e, h, inter, generator=g) / inter**0.5).to(torch.bfloat16).cuda()
    weights, ids = ops.moe_topk(torch.randn(t, e, generator=g).cuda(), top_k, renormalize=True)
    want = reference.fused_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(ops.fused_moe(x, w13, w2, weights, ids), want, **BF16)


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

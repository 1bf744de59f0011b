"""The wide fused Gated DeltaNet decode kernel (`gdn_decode_wide.py`: a batch that fills the GPU,
its state walked in tiles) against the op's torch reference, and which decode kernel a batch
takes.

Under TRITON_INTERPRET=1 on CPU in fp32 and fp16 (compiled on a GPU); the state in fp32 and in
fp16 (the 16-bit state of `--mamba-ssm-cache-dtype`; bf16 arithmetic is wrong in the
interpreter, the GPU tests take bf16). Shapes are awkward on purpose: GROUP 1, 2 and 3, odd head
counts, head dims that are not powers of two, conv widths 4 and 3, a batch that is not a power of
two with padding rows (slot -1), fresh rows on dirty slots, tiles partly or wholly past Dv.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hybrid_cases import gdn_decode_case
from hybrid_cases import run_on_state_copies as _run

from atom_kernels import reference

# (Hk, Hv, Dk, Dv, conv width): GROUP 2 with Dv 12; GROUP 1 with 3 heads; GROUP 3, width 3.
SHAPES = [(2, 4, 8, 12, 4), (3, 3, 16, 16, 4), (2, 6, 12, 8, 3)]
# 7 rows (not a power of two), two of them padding, two fresh.
ROWS = dict(
    slots=[3, -1, 0, 5, 2, -1, 7],
    resume=[True, True, False, True, False, True, True],
    num_slots=9,
)
TOL = {
    (torch.float32, torch.float32): dict(atol=1e-5, rtol=1e-5),
    (torch.float32, torch.float16): dict(atol=1e-5, rtol=1e-5),
    (torch.float16, torch.float32): dict(atol=3e-3, rtol=3e-3),
    (torch.float16, torch.float16): dict(atol=3e-3, rtol=3e-3),
}


def _case(shape, **kw):
    hk, hv, dk, dv, width = shape
    return gdn_decode_case(hk=hk, hv=hv, dk=dk, dv=dv, width=width, **kw)


def _check(kernels, case, launch, tol):
    fn = kernels["gdn_decode_wide"].gated_delta_net_decode_wide_
    got = _run(lambda **c: fn(**c, **launch), case)
    want = _run(reference.gated_delta_net_decode_, case)
    for g, w in zip(got, want, strict=True):  # both states whole: untouched slots included
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, **tol)
    assert torch.count_nonzero(got[0][[1, 5]]) == 0  # the padding rows


@pytest.mark.parametrize(
    ("dtype", "state_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.float16, torch.float32),
        (torch.float16, torch.float16),
        (torch.float32, torch.float16),
    ],
)
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_reference(kernels, device, shape, dtype, state_dtype):
    """Outputs and both states as the reference gives them, at the rule's launch shape: the
    state read and written in its own dtype, the math in fp32."""
    case = _case(shape, **ROWS, seed=70, dtype=dtype, state_dtype=state_dtype, device=device)
    _check(kernels, case, {}, TOL[dtype, state_dtype])


@pytest.mark.parametrize(
    "launch",
    [{"block_v": 4}, {"block_v": 8, "prefetch": False}, {"block_v": 16, "num_warps": 2}],
    ids=["tiles-of-4", "no-prefetch", "16-columns-2-warps"],
)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.float16])
def test_every_launch_shape_matches_reference(kernels, device, state_dtype, launch):
    """Dv 12 in tiles of 4 (three a head, the prefetch crossing heads), of 8 (the second
    partly past Dv, no prefetch) and of 16 (one, partly past Dv, at 2 warps)."""
    case = _case(SHAPES[0], **ROWS, seed=77, state_dtype=state_dtype, device=device)
    _check(kernels, case, launch, TOL[torch.float32, state_dtype])


@pytest.mark.parametrize("prefetch", [True, False])
def test_fresh_rows_ignore_dirty_slots_and_padding_rows_touch_nothing(kernels, device, prefetch):
    """Slots that no row uses and the slots of fresh rows (has_initial_state False) hold NaN:
    the fresh rows start from a zero window and state, their slots end up finite, the unused
    slots stay NaN, the padding row's output is exactly zero even with NaN gates in its row."""
    case = _case(SHAPES[0], slots=[1, -1, 4, 6], resume=[True, True, False, False], seed=71,
                 num_slots=8, device=device)  # fmt: skip
    for name in ("conv_state", "ssm_state"):
        case[name][[0, 2, 3, 4, 5, 6, 7]] = float("nan")
    case["proj"][1] = float("nan")
    fn = kernels["gdn_decode_wide"].gated_delta_net_decode_wide_
    out, conv_state, ssm_state = _run(lambda **c: fn(**c, block_v=4, prefetch=prefetch), case)
    want = _run(reference.gated_delta_net_decode_, case)
    assert torch.isfinite(out[[0, 2, 3]]).all()
    assert torch.count_nonzero(out[1]) == 0
    for state in (conv_state, ssm_state):
        assert torch.isfinite(state[[1, 4, 6]]).all()
        assert torch.isnan(state[[0, 2, 3, 5, 7]]).all()
    for g, w in zip((out, conv_state, ssm_state), want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5, equal_nan=True)


def test_two_steps_carry_the_state_and_a_reused_slot_starts_over(kernels, device):
    """Step 2 resumes slot 1 from step 1's state (conv window and recurrent matrix), and gives
    slot 0 (dirty from step 1) to a new sequence that starts from zeros."""
    first = _case(SHAPES[2], slots=[0, 1], resume=[True, False], seed=72, device=device)
    second = _case(SHAPES[2], slots=[1, 0, 2], resume=[True, False, True], seed=73,
                   device=device)  # fmt: skip
    fn = kernels["gdn_decode_wide"].gated_delta_net_decode_wide_
    results = {}
    for name, step in (("kernel", fn), ("reference", reference.gated_delta_net_decode_)):
        out1, conv_state, ssm_state = _run(step, first)
        shared = {"conv_state": conv_state, "ssm_state": ssm_state}
        results[name] = (out1, *_run(step, {**second, **shared}))
    for g, w in zip(results["kernel"], results["reference"], strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_a_batch_that_fills_the_gpu_takes_the_wide_kernel(kernels, device, monkeypatch):
    """`gdn_decode.gated_delta_net_decode_` (the op's Triton implementation) hands a batch to
    the wide kernel once its (row, k head) programs outnumber the multiprocessors twice over;
    an explicit split keeps gdn_decode.py's kernel; ATOM_GDN_DECODE=split|wide forces one."""
    wide = kernels["gdn_decode_wide"]
    calls = []
    real = wide.gated_delta_net_decode_wide_
    monkeypatch.setattr(
        wide, "gated_delta_net_decode_wide_", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    monkeypatch.setattr(kernels["gdn_decode"], "_multiprocessors", lambda _device: 3)
    case = _case(SHAPES[0], **ROWS, seed=74, device=device)  # 7 rows x 2 k heads > 2 x 3
    want = _run(reference.gated_delta_net_decode_, case)
    for kwargs, takes_wide in (({}, True), ({"v_split": 1}, False)):
        calls.clear()
        fn = functools.partial(kernels["gdn_decode"].gated_delta_net_decode_, **kwargs)
        got = _run(fn, case)
        assert calls == ([1] if takes_wide else [])
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    assert wide.takes_wide_path(4, 2, 3) is True and wide.takes_wide_path(3, 2, 3) is False
    monkeypatch.setattr(wide, "DECODE_PATH", "split")
    assert wide.takes_wide_path(256, 16, 132) is False
    monkeypatch.setattr(wide, "DECODE_PATH", "wide")
    assert wide.takes_wide_path(1, 16, 132) is True and wide.takes_wide_path(0, 16, 132) is False


def test_qwen3_5_4b_on_an_h200_goes_wide_from_17_rows(kernels):
    """16 k heads on 132 multiprocessors: up to 16 rows gdn_decode.py splits Dv (its figures),
    from 17 rows the wide kernel."""
    wide = kernels["gdn_decode_wide"]
    if wide.DECODE_PATH != "auto":
        pytest.skip(f"ATOM_GDN_DECODE={wide.DECODE_PATH} forces a path")
    assert not wide.takes_wide_path(16, 16, 132)
    assert wide.takes_wide_path(17, 16, 132) and wide.takes_wide_path(256, 16, 132)
    assert kernels["gdn_decode"].decode_v_split(17, 16, 128, 132) == 1


def test_launch_shapes_rule_candidates_and_the_timed_choice(kernels, monkeypatch):
    """The rule: 4,096-value tiles at 4 warps, prefetched; the candidates start with the rule,
    are distinct, powers of two within Dv; a shape set for a layer is used for exactly that
    layer, a timed win of gdn_decode.py's kernel sends that layer's full batches back to it,
    and None goes back to the rule."""
    wide = kernels["gdn_decode_wide"]
    monkeypatch.setattr(wide, "DECODE_PATH", "auto")
    rule = wide.rule_config(128, 128)
    assert rule == {"kernel": "wide", "block_v": 32, "num_warps": 4, "prefetch": True}
    assert wide.rule_config(12, 12)["block_v"] == 16  # at least 16 columns, within Dv's block
    candidates = wide.launch_candidates(128, 128)
    assert candidates[0] == rule and len(candidates) == len({str(c) for c in candidates}) > 3
    for c in candidates:
        assert c["block_v"] & (c["block_v"] - 1) == 0 and 16 <= c["block_v"] <= 128
    layer = wide.layer_key(16, 32, 128, 128, torch.bfloat16)
    other = wide.layer_key(16, 32, 128, 128, torch.float32)
    try:
        wide.set_launch_shape(layer, candidates[-1])
        assert wide.launch_config(layer) == candidates[-1]
        assert wide.launch_config(other) == rule
        assert wide.takes_wide_path(256, 16, 132, layer)
        wide.set_launch_shape(layer, {"kernel": "split"})
        assert not wide.takes_wide_path(256, 16, 132, layer)
        assert wide.takes_wide_path(256, 16, 132, other)
        assert wide.launch_config(layer) == rule
    finally:
        wide.set_launch_shape(layer, None)
    assert wide.launch_config(layer) == rule and wide.takes_wide_path(256, 16, 132, layer)


def test_a_tile_wider_than_dv_is_refused(kernels, device):
    case = _case(SHAPES[2], **ROWS, seed=75, device=device)  # Dv 8
    with pytest.raises(ValueError, match="block_v=16"):
        kernels["gdn_decode_wide"].gated_delta_net_decode_wide_(**case, block_v=16)


def test_the_start_up_choice_times_every_candidate_and_keeps_the_fastest(
    kernels, tiny_hybrid_models, monkeypatch
):
    """`worker.gdn_decode_choice` on a tiny hybrid's own GDN layers (the kernels interpreted;
    the CUDA graph timing, which needs a GPU, replaced by given times): every wide candidate and
    gdn_decode.py's kernel run on every layer, the fastest is set for the layer shape (a wide
    launch shape, or the split kernel, whose win sends full batches back to it), the slots it
    ran on are zero again; a forced path or a batch the split kernel serves times nothing."""
    import atom_runtime.worker.gdn_decode_choice as choice
    from atom_runtime import LLM

    wide = kernels["gdn_decode_wide"]
    monkeypatch.setattr(wide, "DECODE_PATH", "auto")
    llm = LLM(str(tiny_hybrid_models["qwen3_5"]), dtype="float32", num_gpu_blocks_override=16)
    layers = llm.engine.executor.state.layers
    candidates = wide.launch_candidates(16, 16) + [{"kernel": "split"}]
    winner = {"index": 1}
    timed = []

    def given_times(*fns):
        for fn in fns:
            fn()  # the real launches, interpreted
        timed.append(len(fns))
        return [0.5 if i == winner["index"] else 1.0 + i for i in range(len(fns))]

    class Props:
        multi_processor_count = 1

    monkeypatch.setattr(choice, "graph_times", given_times)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: Props())
    cuda = torch.device("cuda")
    layer = wide.layer_key(2, 4, 16, 16, torch.float32)
    try:
        assert choice.choose_gdn_decode_launch(layers, cuda, 3) == candidates[1]
        assert timed == [len(candidates)]
        assert wide.launch_config(layer) == candidates[1]
        assert wide.takes_wide_path(3, 2, 1, layer)
        for m in layers:
            assert torch.count_nonzero(m.conv_state) == 0 and torch.count_nonzero(m.ssm_state) == 0
        winner["index"] = len(candidates) - 1
        assert choice.choose_gdn_decode_launch(layers, cuda, 3) == {"kernel": "split"}
        assert not wide.takes_wide_path(3, 2, 1, layer)
        assert choice.choose_gdn_decode_launch(layers, cuda, 1) is None  # 1 x 2 <= 2 x 1
        assert choice.choose_gdn_decode_launch(layers, torch.device("cpu"), 3) is None
        monkeypatch.setattr(wide, "DECODE_PATH", "split")
        assert choice.choose_gdn_decode_launch(layers, cuda, 3) is None
        assert timed == [len(candidates)] * 2
    finally:
        wide.set_launch_shape(layer, None)
        llm.shutdown()

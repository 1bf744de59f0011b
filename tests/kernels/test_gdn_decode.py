"""The fused Gated DeltaNet decode op (`gated_delta_net_decode_`) and the prefill gates
(`gdn_gating`).

The torch reference of the fused op is pinned against the unfused chain of reference ops the
model ran before (conv1d, the gates in torch, the delta rule, the gated norm); the Triton
kernels are pinned against the references, under TRITON_INTERPRET=1 on CPU in fp32 and fp16
(compiled on a GPU). Shapes are awkward on purpose: GROUP 1, 2 and 3, head dims that are not
powers of two, conv widths 4 and 3, padding rows, fresh rows on dirty slots, several slots.
"""

from __future__ import annotations

import pytest
import torch
from hybrid_cases import gdn_decode_case, unfused_gdn_decode
from hybrid_cases import run_on_state_copies as _run

from atom_kernels import ops, reference

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=3e-3, rtol=3e-3)}
ROWS = dict(slots=[3, -1, 0, 5, 2], resume=[True, True, False, True, False])
# (Hk, Hv, Dk, Dv, conv width): GROUP 2 with Dv not a power of two; GROUP 1; GROUP 3, width 3.
SHAPES = [(2, 4, 8, 12, 4), (1, 1, 16, 16, 4), (2, 6, 12, 8, 3)]


def _case(shape, **kw):
    hk, hv, dk, dv, width = shape
    return gdn_decode_case(hk=hk, hv=hv, dk=dk, dv=dv, width=width, **kw)


@pytest.mark.parametrize("shape", SHAPES)
def test_reference_equals_the_unfused_chain(shape):
    case = _case(shape, **ROWS, seed=50)
    got = _run(reference.gated_delta_net_decode_, case)
    want = _run(lambda **c: unfused_gdn_decode(**c, ops=reference), case)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)
    assert torch.count_nonzero(got[0][1]) == 0  # the padding row


@pytest.mark.parametrize("v_split", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_reference(kernels, device, dtype, shape, v_split):
    """Unsplit and with Dv split across programs (the last one to arrive norms the heads and
    shifts the q/k windows); Dv 12 in tiles of 8 or 4 leaves a tile partly or wholly past Dv."""
    case = _case(shape, **ROWS, seed=51, dtype=dtype, device=device)
    fn = kernels["gdn_decode"].gated_delta_net_decode_
    got = _run(lambda **c: fn(**c, v_split=v_split), case)
    want = _run(reference.gated_delta_net_decode_, case)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else TOL[dtype]
    for g, w in zip(got, want, strict=True):  # both states whole: untouched slots included
        torch.testing.assert_close(g, w, **tol)


@pytest.mark.parametrize("v_split", [1, 4])
def test_fresh_rows_ignore_dirty_slots_and_padding_rows_touch_nothing(kernels, device, v_split):
    """Slots that no row uses and the slot of a fresh row (has_initial_state False) hold NaN:
    the fresh row starts from a zero window and state, its slot ends up finite, the unused
    slots stay NaN, and the padding row's output is exactly zero."""
    case = _case((2, 4, 8, 12, 4), slots=[1, -1, 4], resume=[True, True, False], seed=52,
                 device=device)  # fmt: skip
    for name in ("conv_state", "ssm_state"):
        case[name][[0, 2, 3, 4, 5]] = float("nan")
    fn = kernels["gdn_decode"].gated_delta_net_decode_
    out, conv_state, ssm_state = _run(lambda **c: fn(**c, v_split=v_split), case)
    want = _run(reference.gated_delta_net_decode_, case)
    assert torch.isfinite(out).all()
    assert torch.count_nonzero(out[1]) == 0
    for state in (conv_state, ssm_state):
        assert torch.isfinite(state[[1, 4]]).all()
        assert torch.isnan(state[[0, 2, 3, 5]]).all()
    for g, w in zip((out, conv_state, ssm_state), want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4, equal_nan=True)


@pytest.mark.parametrize("v_split", [1, 2])
def test_two_steps_carry_the_state_and_a_reused_slot_starts_over(kernels, device, v_split):
    """Step 2 resumes slot 1 from step 1's state, and gives slot 0 (dirty from step 1) to a new
    sequence that starts from zeros; the kernel's states and outputs follow the reference's."""
    first = _case((2, 4, 8, 12, 4), slots=[0, 1], resume=[True, False], seed=53, device=device)
    second = _case((2, 4, 8, 12, 4), slots=[1, 0, 2], resume=[True, False, True], seed=54,
                   device=device)  # fmt: skip
    states = {}
    kernel = kernels["gdn_decode"].gated_delta_net_decode_
    for name, fn in (
        ("kernel", lambda **c: kernel(**c, v_split=v_split)),
        ("reference", reference.gated_delta_net_decode_),
    ):
        out1, conv_state, ssm_state = _run(fn, first)
        shared = {"conv_state": conv_state, "ssm_state": ssm_state}
        out2, conv_state, ssm_state = _run(fn, {**second, **shared})
        states[name] = (out1, out2, conv_state, ssm_state)
    for g, w in zip(states["kernel"], states["reference"], strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_dv_is_split_until_the_group_fits_the_state_tile(kernels, device, monkeypatch):
    """A state tile of 16 x 16 values splits the GROUP-3 (4 with padding) x 16 x 16 state of a
    k head in four, the last program norming the heads."""
    monkeypatch.setattr(kernels["gdn_decode"], "MAX_STATE_TILE", 16 * 16)
    case = _case((1, 3, 16, 16, 4), **ROWS, seed=55, device=device)
    got = _run(kernels["gdn_decode"].gated_delta_net_decode_, case)
    want = _run(reference.gated_delta_net_decode_, case)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_dv_is_split_until_the_grid_fills_the_gpu(kernels):
    split = kernels["gdn_decode"].decode_v_split
    # Qwen3.5-4B (16 k heads, Dv 128) on an H200's 132 multiprocessors.
    assert [split(b, 16, 128, 132) for b in (1, 2, 4, 8, 16, 32)] == [8, 8, 8, 8, 4, 1]
    assert split(1, 16, 64, 132) == 4  # tiles of no fewer than 16 columns
    assert split(1, 16, 32, 132) == 1  # (never 2)
    assert split(1, 2, 16, 4) == 1


def test_a_split_launch_leaves_its_counters_at_zero(kernels, device):
    """The arrival counters are shared with every ticketed kernel: after a split launch they
    are all back at zero, so the next launch (or a CUDA graph replay) starts clean."""
    from atom_kernels.tickets import ticket_counters

    case = _case((2, 4, 8, 12, 4), **ROWS, seed=57, device=device)
    _run(lambda **c: kernels["gdn_decode"].gated_delta_net_decode_(**c, v_split=4), case)
    assert torch.count_nonzero(ticket_counters(device, 1)) == 0


def test_ops_dispatch_the_fused_ops_to_triton(kernels, device, monkeypatch):
    monkeypatch.setenv("ATOM_KERNEL_BACKEND", "triton")
    ops.refresh_backend()
    calls = []
    real = kernels["gdn_decode"].gated_delta_net_decode_
    monkeypatch.setattr(
        kernels["gdn_decode"],
        "gated_delta_net_decode_",
        lambda *a, **k: calls.append(1) or real(*a, **k),
    )
    try:
        case = _case((2, 4, 8, 12, 4), **ROWS, seed=56, device=device)
        got = _run(ops.gated_delta_net_decode_, case)
        want = _run(reference.gated_delta_net_decode_, case)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
        assert calls == [1]
    finally:
        monkeypatch.delenv("ATOM_KERNEL_BACKEND")
        ops.refresh_backend()


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda c: c.update(proj=c["proj"][:, 1:]), "proj width"),
        (lambda c: c.update(slot_ids=c["slot_ids"].long()), "slot_ids must be int32"),
        (lambda c: c.update(has_initial_state=c["has_initial_state"][:2]), "has_initial_state"),
        (lambda c: c.update(conv_state=c["conv_state"][..., :2]), "conv_state must be"),
        (lambda c: c.update(conv_weight=c["conv_weight"][:-1]), "channels are not"),
        (lambda c: c.update(norm_weight=c["norm_weight"][:-1]), "norm_weight must be"),
        (lambda c: c.update(a_log=c["a_log"][:-1]), "a_log and dt_bias"),
    ],
)
def test_fused_decode_rejects_inconsistent_arguments(change, match):
    case = _case((2, 4, 8, 12, 4), **ROWS, seed=57)
    change(case)
    with pytest.raises(ValueError, match=match):
        ops.gated_delta_net_decode_(**case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gdn_gating_kernel_matches_reference(kernels, device, dtype):
    """Strided a and b (columns of a projection) over the whole range softplus and sigmoid
    see: past softplus's threshold of 20, and far below 0 where log(1 + exp(x)) alone would
    lose every digit."""
    g = torch.Generator().manual_seed(58)
    t, hv = 37, 6
    wide = (torch.randn(t, 2 * hv + 3, generator=g) * 12).to(dtype).to(device)
    wide[0, :hv] = torch.tensor([25.0, 20.5, -30.0, -60.0, 0.0, 19.5]).to(dtype)
    a, b = wide[:, :hv], wide[:, hv + 1 : 2 * hv + 1]
    a_log = torch.randn(hv, generator=g).to(dtype).to(device)
    dt_bias = torch.zeros(hv, dtype=dtype, device=device)
    got_g, got_beta = kernels["gdn"].gdn_gating(a, b, a_log, dt_bias)
    want_g, want_beta = reference.gdn_gating(a, b, a_log, dt_bias)
    torch.testing.assert_close(got_g, want_g, atol=0, rtol=1e-5)
    torch.testing.assert_close(got_beta, want_beta, atol=1e-7, rtol=1e-6)
    assert got_g.dtype == got_beta.dtype == torch.float32 and got_g.is_contiguous()

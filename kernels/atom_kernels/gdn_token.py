"""What both fused Gated DeltaNet decode kernels share: one token's causal conv with the shift of
its window, the gated RMSNorm over a head's Dv, and the layer's dimensions read off the
arguments (`gdn_decode.py` for small batches, `gdn_decode_wide.py` for batches that fill the
GPU)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


@triton.jit
def conv_token(
    x_row, conv_w_ptr, window_row, ch, live, resume, cs_stride_c, cs_stride_w, WIDTH: tl.constexpr,
    BLOCK_W: tl.constexpr,
):  # fmt: skip
    """The causal conv + silu of one token over channels `ch` ([C], `live` masks them; `resume`
    those whose window is read, zeros elsewhere). Returns the output (fp32, rounded through
    x's dtype as the conv kernel's output would be) and the shifted window `[C, BLOCK_W]`
    (columns < WIDTH - 1 are the new window, oldest first) for the caller to store once every
    thread has read the old one (a barrier: an element may sit in several threads)."""
    j = tl.arange(0, BLOCK_W)
    x = tl.load(x_row + ch, mask=live, other=0.0).to(tl.float32)
    window = window_row + ch.to(tl.int64)[:, None] * cs_stride_c + j[None, :] * cs_stride_w
    old = tl.load(window, mask=resume[:, None] & (j < WIDTH - 1)[None, :], other=0.0)
    taps = tl.where((j == WIDTH - 1)[None, :], x[:, None], old.to(tl.float32))
    w_mask = live[:, None] & (j < WIDTH)[None, :]
    w = tl.load(conv_w_ptr + ch[:, None] * WIDTH + j[None, :], mask=w_mask, other=0.0)
    acc = tl.sum(taps * w.to(tl.float32), axis=1)
    y = (acc / (1.0 + tl.exp(-acc))).to(x_row.dtype.element_ty).to(tl.float32)
    # The new window is the old one shifted by one, the token last: loaded shifted rather than
    # moved between registers.
    shifted = tl.load(
        window + cs_stride_w, mask=resume[:, None] & (j + 1 < WIDTH - 1)[None, :], other=0.0
    )
    shifted = tl.where((j + 1 == WIDTH - 1)[None, :], x[:, None], shifted.to(tl.float32))
    return y, shifted


@triton.jit
def row_pointers(
    row, slot_ids_ptr, has_initial_state_ptr, proj_ptr, proj_stride, conv_state_ptr, cs_stride_s,
    ssm_state_ptr, ss_stride_s,
):  # fmt: skip
    """Where a decode row's data lives: (real: it has a state slot, resume: its state is read,
    its in_proj row, its conv window, its recurrent state)."""
    slot = tl.load(slot_ids_ptr + row)
    resume = tl.load(has_initial_state_ptr + row) != 0
    x_row = proj_ptr + row.to(tl.int64) * proj_stride
    window_row = conv_state_ptr + slot.to(tl.int64) * cs_stride_s
    state_row = ssm_state_ptr + slot.to(tl.int64) * ss_stride_s
    return slot >= 0, resume, x_row, window_row, state_row


@triton.jit
def conv_qk(
    x_row, conv_w_ptr, window_row, kh, dk, live, resume, cs_stride_c, cs_stride_w, HK, DK,
    WIDTH: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    """`conv_token` over k head `kh`'s q and k channels (`dk`: its offsets within a head):
    their channel indices, outputs and shifted windows, (q_ch, k_ch, q, q_window, k, k_window)."""
    q_ch = kh * DK + dk
    k_ch = HK * DK + kh * DK + dk
    q, q_window = conv_token(
        x_row, conv_w_ptr, window_row, q_ch, live, resume, cs_stride_c, cs_stride_w, WIDTH, BLOCK_W
    )
    k, k_window = conv_token(
        x_row, conv_w_ptr, window_row, k_ch, live, resume, cs_stride_c, cs_stride_w, WIDTH, BLOCK_W
    )
    return q_ch, k_ch, q, q_window, k, k_window


@triton.jit
def gated_norm(o, z, norm_w, gate_mask, eps, DV: tl.constexpr):
    """RMSNorm over Dv of o ([G, Dv] fp32, zeros past Dv), times silu(z); zero where masked
    (padding rows)."""
    inv_rms = tl.rsqrt(tl.sum(o * o, axis=1) / DV + eps)
    z = z.to(tl.float32)
    y = o * inv_rms[:, None] * norm_w[None, :] * (z / (1.0 + tl.exp(-z)))
    return tl.where(gate_mask, y, 0.0)


class DecodeDims(NamedTuple):
    """A GDN decode launch's sizes: rows, k heads, v heads, v heads per k head, head dims, conv
    channels and width."""

    batch: int
    hk: int
    hv: int
    group: int
    dk: int
    dv: int
    conv_dim: int
    width: int


def decode_dims(
    proj: torch.Tensor,
    conv_weight: torch.Tensor,
    ssm_state: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
) -> DecodeDims:
    """The sizes from the argument shapes (`ops.gated_delta_net_decode_` checked them against
    each other), after the layouts the kernels index directly: contiguous parameters, a state
    with a contiguous last dim."""
    for name, t in (
        ("conv_weight", conv_weight), ("a_log", a_log), ("dt_bias", dt_bias),
        ("norm_weight", norm_weight),
    ):  # fmt: skip
        if not t.is_contiguous():
            raise ValueError(f"gated_delta_net_decode_ needs a contiguous {name}")
    if ssm_state.stride(3) != 1:
        raise ValueError("gated_delta_net_decode_ needs ssm_state with a contiguous last dim")
    hv, dk, dv = ssm_state.shape[1:]
    conv_dim, width = conv_weight.shape
    hk = (conv_dim - hv * dv) // (2 * dk)
    return DecodeDims(proj.shape[0], hk, hv, hv // hk, dk, dv, conv_dim, width)

"""Triton fused decode step of a Gated DeltaNet layer: one launch from the in_proj output of one
token per row to the input of out_proj.

The unfused chain is a conv1d launch (and its state-update launch), about eight elementwise
launches for the gates, the recurrence and the gated norm, plus the copies between them. At batch
1 each of those is a couple of microseconds of launch gap inside a CUDA graph and almost no work,
so one program does it all: it reads its channels of the projection row, convolves them with the
slot's conv window (and shifts the window), computes beta and g, L2-normalises q and k, advances
the recurrent state one token and applies the gated RMSNorm with z.

Batches that fill the GPU run `gdn_decode_wide.py`'s kernel instead (the same op streaming the
state in tiles; `gated_delta_net_decode_` below decides), unless ATOM_GDN_DECODE=split.

Program layout: one program per (row, k head, Dv tile), holding the `[GROUP, Dk, Dv / V_SPLIT]`
fp32 state of the GROUP v heads that k head serves, for its tile of Dv columns.

- Unsplit (V_SPLIT 1, what a batch that fills the GPU runs) a program owns every conv-window
  channel it reads: q and k of its k head and v of its v heads. The window must be read before
  it is shifted; here the read, a barrier and the write are in program order, and q, k's conv
  and L2 norm are computed once per k head, not GROUP times. It holds whole Dv rows, so the
  gated norm over Dv needs no second pass.
- Unsplit, a batch-1 row has Hk programs (16 for Qwen3.5-4B) each walking 128 KiB of state: most
  of the GPU idles. So small batches split Dv across V_SPLIT programs (`decode_v_split`; 8 at
  batch 1 on an H200: 128 programs of 16 KiB). Each recomputes q and k (a few hundred channels)
  and owns its tile's v channels and state columns, writing o unnormed. The q/k windows, read
  by all of them, and the gated norm, which spans the head's Dv, are left to the last program
  of the k head to arrive (an arrival counter, `atom_kernels.tickets`): the others have read
  the windows and written their o by then.
- Every Qwen3.5/Next config has GROUP 2: unsplit a program holds 2 x 128 x 128 fp32 = 128 KiB of
  state (8 warps: 255 registers a thread, no spills). A larger GROUP x Dk x Dv than
  `MAX_STATE_TILE` values splits Dv until a tile fits (more registers would spill).
- Every load (gates, state tile, z, the three convs' inputs) is issued before anything waits
  on one, and the stores come after one barrier: at batch 1 the launch costs its chain of
  dependent memory round trips, not its bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_kernels import gdn_decode_wide, pdl
from atom_kernels.decode_attention import _multiprocessor_count as _multiprocessors
from atom_kernels.gdn import gdn_gates
from atom_kernels.gdn_token import conv_qk, conv_token, decode_dims, gated_norm, row_pointers
from atom_kernels.pdl import wait_for_inputs
from atom_kernels.tickets import ticket_counters

# fp32 state values a program holds at once (128 KiB): GROUP 2 x 128 x 128.
MAX_STATE_TILE = 32768


@triton.jit
def _gdn_decode_kernel(
    proj_ptr, conv_w_ptr, conv_state_ptr, ssm_state_ptr, a_log_ptr, dt_bias_ptr, norm_w_ptr,
    out_ptr, slot_ids_ptr, has_initial_state_ptr, tickets_ptr, scale, eps, proj_stride, out_stride,
    cs_stride_s, cs_stride_c, cs_stride_w, ss_stride_s, ss_stride_h, ss_stride_k, HK: tl.constexpr,
    HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, WIDTH: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, V_SPLIT: tl.constexpr,
    BLOCK_W: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    kh = tl.program_id(1)
    v_tile = tl.program_id(2)
    real, resume, x_row, window_row, state_row = row_pointers(
        row, slot_ids_ptr, has_initial_state_ptr, proj_ptr, proj_stride, conv_state_ptr,
        cs_stride_s, ssm_state_ptr, ss_stride_s,
    )  # fmt: skip
    conv_dim = 2 * HK * DK + HV * DV
    j = tl.arange(0, BLOCK_W)
    in_window = (j < WIDTH - 1)[None, :]
    # Scalar conditions fold into the bounds (the interpreter rejects block & scalar masks).
    dk = tl.arange(0, BLOCK_K)
    k_live = dk < tl.where(real, DK, 0)
    k_resume = dk < tl.where(real & resume, DK, 0)
    gi = tl.arange(0, BLOCK_G)  # the k head's v heads (BLOCK_G >= GROUP)
    heads = kh * GROUP + gi
    g_ok = gi < GROUP
    g_live = gi < tl.where(real, GROUP, 0)
    g_resume = gi < tl.where(real & resume, GROUP, 0)
    dv = v_tile * BLOCK_V + tl.arange(0, BLOCK_V)  # this program's Dv columns
    dv_ok = dv < DV

    # Every load is issued before anything waits on one (a chain of dependent loads is what a
    # batch-1 launch costs): the gates, the state tile, z, then the three convs' inputs.
    b = tl.load(x_row + conv_dim + HV * DV + heads, mask=g_live, other=0.0)
    a = tl.load(x_row + conv_dim + HV * DV + HV + heads, mask=g_live, other=0.0)
    a_log = tl.load(a_log_ptr + heads, mask=g_live, other=0.0)
    dt_bias = tl.load(dt_bias_ptr + heads, mask=g_live, other=0.0)
    s_ptrs = state_row + heads.to(tl.int64)[:, None, None] * ss_stride_h
    s_ptrs += dk[None, :, None] * ss_stride_k + dv[None, None, :]
    kv_ok = (dk < DK)[None, :, None] & dv_ok[None, None, :]
    s = tl.load(s_ptrs, mask=g_resume[:, None, None] & kv_ok, other=0.0)
    gate_mask = g_live[:, None] & dv_ok[None, :]
    z = tl.zeros([BLOCK_G, BLOCK_V], dtype=tl.float32)
    if V_SPLIT == 1:
        z_ptrs = x_row + conv_dim + heads[:, None] * DV + dv[None, :]
        z = tl.load(z_ptrs, mask=gate_mask, other=0.0).to(tl.float32)
    q_ch, k_ch, q, q_window, k, k_window = conv_qk(
        x_row, conv_w_ptr, window_row, kh, dk, k_live, k_resume, cs_stride_c, cs_stride_w, HK, DK,
        WIDTH, BLOCK_W,
    )  # fmt: skip
    # The v channels of the heads' tiles as one flat run, head-major like the projection.
    flat = tl.arange(0, BLOCK_G * BLOCK_V)
    flat_g = flat // BLOCK_V
    flat_v = v_tile * BLOCK_V + flat % BLOCK_V
    v_ch = 2 * HK * DK + (kh * GROUP + flat_g) * DV + flat_v
    f_live = (flat_g < tl.where(real, GROUP, 0)) & (flat_v < DV)
    f_resume = (flat_g < tl.where(real & resume, GROUP, 0)) & (flat_v < DV)
    v, v_window = conv_token(
        x_row, conv_w_ptr, window_row, v_ch, f_live, f_resume, cs_stride_c, cs_stride_w,
        WIDTH, BLOCK_W,
    )  # fmt: skip
    v = tl.reshape(v, (BLOCK_G, BLOCK_V))

    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    g, beta = gdn_gates(a, b, a_log, dt_bias)
    s = s.to(tl.float32) * tl.exp(g)[:, None, None]
    predicted = tl.sum(k[None, :, None] * s, axis=1)
    delta = beta[:, None] * (v - predicted)
    s = s + k[None, :, None] * delta[:, None, :]
    # o rounded as the recurrence kernel's output would be.
    o = tl.sum(q[None, :, None] * s, axis=1).to(out_ptr.dtype.element_ty)

    # Every thread has read the old windows and state before any of them is overwritten (an
    # element may sit in several threads). Split, the q/k windows are the last program's to
    # write: the others read them too.
    tl.debug_barrier()
    window_dtype = conv_state_ptr.dtype.element_ty
    q_dst = window_row + q_ch.to(tl.int64)[:, None] * cs_stride_c + j[None, :] * cs_stride_w
    k_dst = window_row + k_ch.to(tl.int64)[:, None] * cs_stride_c + j[None, :] * cs_stride_w
    v_dst = window_row + v_ch.to(tl.int64)[:, None] * cs_stride_c + j[None, :] * cs_stride_w
    tl.store(v_dst, v_window.to(window_dtype), mask=f_live[:, None] & in_window)
    tl.store(s_ptrs, s.to(ssm_state_ptr.dtype.element_ty), mask=g_live[:, None, None] & kv_ok)
    o_ptrs = out_ptr + row.to(tl.int64) * out_stride + heads[:, None] * DV + dv[None, :]
    o_mask = g_ok[:, None] & dv_ok[None, :]
    if V_SPLIT == 1:
        tl.store(q_dst, q_window.to(window_dtype), mask=k_live[:, None] & in_window)
        tl.store(k_dst, k_window.to(window_dtype), mask=k_live[:, None] & in_window)
        norm_w = tl.load(norm_w_ptr + dv, mask=dv_ok, other=0.0).to(tl.float32)
        y = gated_norm(o.to(tl.float32), z, norm_w, gate_mask, eps, DV)
        tl.store(o_ptrs, y.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        tl.store(o_ptrs, o, mask=o_mask)  # normed below, once the head's tiles are all in

    if V_SPLIT > 1:
        # The gated RMSNorm spans a head's Dv columns, split across V_SPLIT programs: the last
        # of them to arrive norms the k head's v heads (rows of `out` the others wrote), and
        # writes the q/k windows every one of them has read by then (atomic_add's release).
        tl.debug_barrier()
        counter = tickets_ptr + row * HK + kh
        if tl.atomic_add(counter, 1, sem="acq_rel") == V_SPLIT - 1:
            tl.store(q_dst, q_window.to(window_dtype), mask=k_live[:, None] & in_window)
            tl.store(k_dst, k_window.to(window_dtype), mask=k_live[:, None] & in_window)
            cols = tl.arange(0, BLOCK_V * V_SPLIT)
            cols_ok = cols < DV
            norm_all = tl.load(norm_w_ptr + cols, mask=cols_ok, other=0.0).to(tl.float32)
            # (Names differ from those above: Triton rejects a variable whose shape changes.)
            cell = heads[:, None] * DV + cols[None, :]
            head_ok = g_ok[:, None] & cols_ok[None, :]
            head_live = g_live[:, None] & cols_ok[None, :]
            head_out = out_ptr + row.to(tl.int64) * out_stride + cell
            unnormed = tl.load(head_out, mask=head_ok, other=0.0, cache_modifier=".cg")
            gate = tl.load(x_row + conv_dim + cell, mask=head_live, other=0.0)
            normed = gated_norm(unnormed.to(tl.float32), gate, norm_all, head_live, eps, DV)
            tl.store(head_out, normed.to(out_ptr.dtype.element_ty), mask=head_ok)
            tl.store(counter, 0)


def gated_delta_net_decode_(
    proj, conv_weight, conv_state, ssm_state, a_log, dt_bias, norm_weight, eps, slot_ids,
    has_initial_state, scale, *, num_warps=None, v_split=None,
):  # fmt: skip
    """See `atom_kernels.ops.gated_delta_net_decode_`. A batch that fills the GPU goes to the
    wide kernel (`gdn_decode_wide`, unless ATOM_GDN_DECODE=split or an override here); the
    rest runs this module's kernel. `v_split` overrides how many programs share a k head's Dv
    columns (`decode_v_split`); `num_warps` the default (8 for a 128 KiB state tile, fewer for
    smaller ones). On an H200 at Qwen3.5-4B sizes (`benchmarks/gdn_decode_bench.py --sweep`,
    bf16), unsplit: 8 warps 10.2 us a layer at batch 1 and 28.8 at 16, with 255 registers a
    thread and no spills; 16 warps 13.6 / 35.2 (20 registers spilled), 4 warps 76 / 223 (1,260
    spilled), 32 warps 20.2 / 48.8."""
    args = (proj, conv_weight, conv_state, ssm_state, a_log, dt_bias, norm_weight, eps, slot_ids,
            has_initial_state, scale)  # fmt: skip
    dims = decode_dims(proj, conv_weight, ssm_state, a_log, dt_bias, norm_weight)
    batch, hk, hv, group, dk, dv, _, width = dims
    sms = _multiprocessors(proj.device)
    layer = gdn_decode_wide.layer_key(hk, hv, dk, dv, ssm_state.dtype)
    if (
        v_split is None
        and num_warps is None
        and gdn_decode_wide.takes_wide_path(batch, hk, sms, layer)
    ):
        return gdn_decode_wide.gated_delta_net_decode_wide_(*args)
    out = torch.empty((batch, hv * dv), dtype=proj.dtype, device=proj.device)
    if batch == 0:
        return out
    block_k, block_dv = triton.next_power_of_2(dk), triton.next_power_of_2(dv)
    block_g = triton.next_power_of_2(group)
    # A program holds its k head's whole group: Dv is split at least until that fits.
    fits = triton.next_power_of_2(triton.cdiv(block_g * block_k * block_dv, MAX_STATE_TILE))
    if v_split is None:
        v_split = max(fits, decode_v_split(batch, hk, block_dv, sms))
    if v_split < 1 or v_split & (v_split - 1) or v_split > block_dv:
        raise ValueError(f"v_split={v_split}: expected a power of two up to {block_dv}")
    tickets = ticket_counters(proj.device, batch * hk) if v_split > 1 else None
    if tickets is None:  # unsplit, or no counters to grow while a graph is captured (the
        v_split = 1  # tile may then pass MAX_STATE_TILE and spill: slower, still right)
    block_v = block_dv // v_split
    if num_warps is None:
        num_warps = max(4, min(8, block_g * block_k * block_v // 2048))
    _gdn_decode_kernel[(batch, hk, v_split)](
        proj, conv_weight, conv_state, ssm_state, a_log, dt_bias, norm_weight, out, slot_ids,
        has_initial_state.view(torch.uint8), tickets if tickets is not None else slot_ids,
        scale, eps, proj.stride(0), out.stride(0), *conv_state.stride(), ssm_state.stride(0),
        ssm_state.stride(1), ssm_state.stride(2),
        HK=hk, HV=hv, GROUP=group, DK=dk, DV=dv, WIDTH=width, BLOCK_G=block_g,
        BLOCK_K=block_k, BLOCK_V=block_v, V_SPLIT=v_split,
        BLOCK_W=triton.next_power_of_2(width), num_warps=num_warps,
        **pdl.options(conv_state.device),
    )  # fmt: skip
    return out


def decode_v_split(batch: int, hk: int, block_dv: int, multiprocessors: int) -> int:
    """How many programs share a k head's Dv columns: unsplit, a row's Hk programs (16 for
    Qwen3.5-4B) leave most of the GPU idle at small batches. From 4, doubled while the grid
    stays within 8 programs per multiprocessor and tiles keep 16 columns. On an H200 at
    Qwen3.5-4B sizes (`gdn_decode_bench.py --sweep`, us a layer for splits 1 / 2 / 4 / 8):
    batch 1 9.5 / 9.6 / 5.8 / 4.9, batch 4 11.9 / 12.3 / 10.0 / 9.9, batch 16
    30.7 / 43.4 / 26.1 / 38.2 (2 splits, 64-column tiles, lose to both neighbours)."""
    split = 1
    while (
        max(4, 2 * split) * batch * hk <= 8 * multiprocessors
        and block_dv // max(4, 2 * split) >= 16
    ):
        split = max(4, 2 * split)
    return split

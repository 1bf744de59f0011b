"""Triton fused decode step of a Gated DeltaNet layer for batches that fill the GPU: the same op
as `gdn_decode.py` (conv window update and silu, gates, q/k L2 norm, one delta-rule step on the
slot's state, gated RMSNorm with z), laid out for bandwidth instead of latency.

At batch 256 a step of Qwen3.5-4B reads and writes 26 GB of recurrent state (2 MiB a sequence
and layer in fp32), three times its weights: the state stream is the step. `gdn_decode.py`'s
kernel holds a (row, k head)'s whole `[GROUP, Dk, Dv]` state (128 KiB) in registers, 255 a
thread: one program per multiprocessor, which loads everything, computes, then stores, so the
memory sits idle while it computes and between programs. Here a program still owns one
(row, k head), so it owns every conv channel it reads (no arrival counters, no second launch),
but walks its state in `[Dk, BLOCK_V]` tiles (16 KiB), loading the next tile before it works on
the current one; with a few dozen registers a thread several programs share a multiprocessor and
keep its loads in flight. Three phases, one barrier between each:

1. the conv of the token over the k head's q and k channels and its v heads' v channels (the
   windows read, then after the barrier shifted and written back); the conv output of v goes
   to the program's own `[GROUP, Dv]` slice of the output, the scratch the recurrence reads;
2. per state tile: decay, delta-rule update, o over the tile's Dv columns, the tile written
   back in the state's dtype, o (rounded to the output dtype, as the recurrence kernel's
   output is) written over the v it came from;
3. the gated RMSNorm over each head's Dv from those rows, written in place.

The state may be fp32 or 16-bit (`--mamba-ssm-cache-dtype`); the math is fp32 either way.
Launch shape per layer shape and state dtype: the rule (`launch_config`) or what
`set_launch_shape` was given (the start-up timing in `atom_runtime.worker.gdn_decode_choice`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_kernels import envs, pdl
from atom_kernels.gdn import gdn_gates
from atom_kernels.gdn_token import conv_qk, conv_token, decode_dims, gated_norm, row_pointers
from atom_kernels.pdl import wait_for_inputs

# Which fused decode kernel a one-token batch takes (ATOM_GDN_DECODE, read once at import):
# "auto" (this one when the batch fills the GPU, `takes_wide_path`), "split" (always
# gdn_decode.py's: the path before this module) or "wide" (always this one).
DECODE_PATH = envs.GDN_DECODE.value()


@triton.jit
def _state_tile(state_row, head, t, dk, dvb, ss_stride_h, ss_stride_k, BLOCK_V: tl.constexpr):
    """Pointers to tile t (columns t * BLOCK_V ...) of head `head`'s `[Dk, Dv]` state."""
    dv = t * BLOCK_V + dvb
    return state_row + head.to(tl.int64) * ss_stride_h + dk[:, None] * ss_stride_k + dv[None, :]


@triton.jit
def _gdn_decode_wide_kernel(
    proj_ptr, conv_w_ptr, conv_state_ptr, ssm_state_ptr, a_log_ptr, dt_bias_ptr, norm_w_ptr,
    out_ptr, slot_ids_ptr, has_initial_state_ptr, scale, eps, proj_stride, out_stride, cs_stride_s,
    cs_stride_c, cs_stride_w, ss_stride_s, ss_stride_h, ss_stride_k, HK: tl.constexpr,
    HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, WIDTH: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_V: tl.constexpr,
    TILES: tl.constexpr, BLOCK_W: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    kh = tl.program_id(1)
    real, resume, x_row, window_row, state_row = row_pointers(
        row, slot_ids_ptr, has_initial_state_ptr, proj_ptr, proj_stride, conv_state_ptr,
        cs_stride_s, ssm_state_ptr, ss_stride_s,
    )  # fmt: skip
    o_row = out_ptr + row.to(tl.int64) * out_stride + kh * (GROUP * DV)  # this k head's v heads
    conv_dim = 2 * HK * DK + HV * DV
    state_dtype = ssm_state_ptr.dtype.element_ty
    out_dtype = out_ptr.dtype.element_ty
    j = tl.arange(0, BLOCK_W)
    in_window = (j < WIDTH - 1)[None, :]
    # Scalar conditions fold into the bounds (the interpreter rejects block & scalar masks).
    dk = tl.arange(0, BLOCK_K)
    k_live = dk < tl.where(real, DK, 0)
    k_resume = dk < tl.where(real & resume, DK, 0)
    dvb = tl.arange(0, BLOCK_V)
    first_head = kh * GROUP
    if PREFETCH:  # the first state tile is on its way while the convs run
        s_next = tl.load(
            _state_tile(state_row, first_head, 0, dk, dvb, ss_stride_h, ss_stride_k, BLOCK_V),
            mask=k_resume[:, None] & (dvb < DV)[None, :], other=0.0,
            eviction_policy="evict_first",
        )  # fmt: skip

    # 1. The convs: q and k of this k head, v of its GROUP v heads as one flat run.
    q_ch, k_ch, q, q_window, k, k_window = conv_qk(
        x_row, conv_w_ptr, window_row, kh, dk, k_live, k_resume, cs_stride_c, cs_stride_w, HK, DK,
        WIDTH, BLOCK_W,
    )  # fmt: skip
    flat = tl.arange(0, BLOCK_G * BLOCK_DV)
    flat_g = flat // BLOCK_DV
    flat_v = flat % BLOCK_DV
    flat_ok = (flat_g < GROUP) & (flat_v < DV)
    v_ch = 2 * HK * DK + first_head * DV + flat_g * DV + flat_v
    f_live = (flat_g < tl.where(real, GROUP, 0)) & (flat_v < DV)
    f_resume = (flat_g < tl.where(real & resume, GROUP, 0)) & (flat_v < DV)
    v, v_window = conv_token(
        x_row, conv_w_ptr, window_row, v_ch, f_live, f_resume, cs_stride_c, cs_stride_w,
        WIDTH, BLOCK_W,
    )  # fmt: skip
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    # The GROUP heads' decay and write strength, picked per tile below (no loads in the loop).
    gi = tl.arange(0, BLOCK_G)
    g_ok = gi < GROUP
    gates = x_row + conv_dim + HV * DV + first_head + gi
    log_decays, betas = gdn_gates(
        tl.load(gates + HV, mask=g_ok, other=0.0), tl.load(gates, mask=g_ok, other=0.0),
        tl.load(a_log_ptr + first_head + gi, mask=g_ok, other=0.0),
        tl.load(dt_bias_ptr + first_head + gi, mask=g_ok, other=0.0),
    )  # fmt: skip
    decays = tl.exp(log_decays)
    tl.debug_barrier()  # every thread has read the old windows
    window_dtype = conv_state_ptr.dtype.element_ty
    q_dst = window_row + q_ch.to(tl.int64)[:, None] * cs_stride_c + j[None, :] * cs_stride_w
    k_dst = window_row + k_ch.to(tl.int64)[:, None] * cs_stride_c + j[None, :] * cs_stride_w
    tl.store(q_dst, q_window.to(window_dtype), mask=k_live[:, None] & in_window)
    tl.store(k_dst, k_window.to(window_dtype), mask=k_live[:, None] & in_window)
    v_dst = window_row + v_ch.to(tl.int64)[:, None] * cs_stride_c + j[None, :] * cs_stride_w
    tl.store(v_dst, v_window.to(window_dtype), mask=f_live[:, None] & in_window)
    # v, rounded as the conv's output, parked where o goes (flat is head-major like `out`).
    tl.store(o_row + flat_g * DV + flat_v, v.to(out_dtype), mask=flat_ok)
    tl.debug_barrier()  # ... and visible to every thread of the program

    # 2. The recurrence, one [Dk, BLOCK_V] tile at a time, the next one already loading.
    for step in range(0, GROUP * TILES):
        g = step // TILES
        t = step % TILES
        head = first_head + g
        tile = _state_tile(state_row, head, t, dk, dvb, ss_stride_h, ss_stride_k, BLOCK_V)
        dv = t * BLOCK_V + dvb
        dv_ok = dv < DV
        if PREFETCH:
            s = s_next.to(tl.float32)
            nxt = step + 1
            more = dk < tl.where(real & resume & (nxt < GROUP * TILES), DK, 0)
            nxt_tile = _state_tile(
                state_row, first_head + nxt // TILES, nxt % TILES, dk, dvb, ss_stride_h,
                ss_stride_k, BLOCK_V,
            )  # fmt: skip
            nxt_ok = ((nxt % TILES) * BLOCK_V + dvb) < DV
            s_next = tl.load(
                nxt_tile, mask=more[:, None] & nxt_ok[None, :], other=0.0,
                eviction_policy="evict_first",
            )  # fmt: skip
        else:
            s = tl.load(
                tile, mask=k_resume[:, None] & dv_ok[None, :], other=0.0,
                eviction_policy="evict_first",
            ).to(tl.float32)  # fmt: skip
        decay = tl.sum(tl.where(gi == g, decays, 0.0), axis=0)
        beta = tl.sum(tl.where(gi == g, betas, 0.0), axis=0)
        v_tile = tl.load(o_row + g * DV + dv, mask=dv_ok, other=0.0, cache_modifier=".cg")
        s = s * decay
        predicted = tl.sum(k[:, None] * s, axis=0)
        delta = beta * (v_tile.to(tl.float32) - predicted)
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(q[:, None] * s, axis=0)
        tl.store(tile, s.to(state_dtype), mask=k_live[:, None] & dv_ok[None, :])
        # Over the v it came from: each o column is a sum over every thread that read that
        # column's v, so none is overwritten before it is read.
        tl.store(o_row + g * DV + dv, o.to(out_dtype), mask=dv_ok)

    # 3. The gated RMSNorm over each head's Dv, from the rows just written.
    tl.debug_barrier()
    cols = tl.arange(0, BLOCK_DV)
    cell = gi[:, None] * DV + cols[None, :]
    head_ok = g_ok[:, None] & (cols < DV)[None, :]
    head_live = (gi < tl.where(real, GROUP, 0))[:, None] & (cols < DV)[None, :]
    unnormed = tl.load(o_row + cell, mask=head_ok, other=0.0, cache_modifier=".cg")
    z = tl.load(x_row + conv_dim + first_head * DV + cell, mask=head_live, other=0.0)
    norm_w = tl.load(norm_w_ptr + cols, mask=cols < DV, other=0.0).to(tl.float32)
    y = gated_norm(unnormed.to(tl.float32), z, norm_w, head_live, eps, DV)
    tl.store(o_row + cell, y.to(out_dtype), mask=head_ok)


def gated_delta_net_decode_wide_(
    proj, conv_weight, conv_state, ssm_state, a_log, dt_bias, norm_weight, eps, slot_ids,
    has_initial_state, scale, *, block_v=None, num_warps=None, prefetch=None,
):  # fmt: skip
    """`ops.gated_delta_net_decode_` on this module's kernel, grid (rows, k heads). `block_v`
    (state columns a tile, a power of two), `num_warps` and `prefetch` (load the next tile
    before working on this one) override the layer's launch shape (`launch_config`)."""
    dims = decode_dims(proj, conv_weight, ssm_state, a_log, dt_bias, norm_weight)
    out = torch.empty((dims.batch, dims.hv * dims.dv), dtype=proj.dtype, device=proj.device)
    if dims.batch == 0:
        return out
    cfg = launch_config(layer_key(dims.hk, dims.hv, dims.dk, dims.dv, ssm_state.dtype))
    block_v = cfg["block_v"] if block_v is None else block_v
    block_dv = triton.next_power_of_2(dims.dv)
    if block_v < 1 or block_v & (block_v - 1) or block_v > block_dv:
        raise ValueError(f"block_v={block_v}: expected a power of two up to {block_dv}")
    _gdn_decode_wide_kernel[(dims.batch, dims.hk)](
        proj, conv_weight, conv_state, ssm_state, a_log, dt_bias, norm_weight, out, slot_ids,
        has_initial_state.view(torch.uint8), scale, eps, proj.stride(0), out.stride(0),
        *conv_state.stride(), ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2),
        HK=dims.hk, HV=dims.hv, GROUP=dims.group, DK=dims.dk, DV=dims.dv, WIDTH=dims.width,
        BLOCK_G=triton.next_power_of_2(dims.group), BLOCK_K=triton.next_power_of_2(dims.dk),
        BLOCK_DV=block_dv, BLOCK_V=block_v, TILES=triton.cdiv(dims.dv, block_v),
        BLOCK_W=triton.next_power_of_2(dims.width),
        PREFETCH=cfg["prefetch"] if prefetch is None else prefetch,
        num_warps=cfg["num_warps"] if num_warps is None else num_warps,
        **pdl.options(conv_state.device),
    )  # fmt: skip
    return out


def takes_wide_path(batch: int, hk: int, multiprocessors: int, layer: tuple | None = None) -> bool:
    """Whether a one-token batch runs this module's kernel. ATOM_GDN_DECODE=auto: once its
    (row, k head) programs outnumber the multiprocessors twice over, where gdn_decode.py stops
    splitting Dv and would hold 128 KiB of state a program, one program a multiprocessor;
    unless the start-up timing found gdn_decode.py's kernel faster for this `layer`
    (`layer_key`)."""
    if DECODE_PATH != "auto":
        return DECODE_PATH == "wide" and batch > 0
    if batch * hk <= 2 * multiprocessors:
        return False
    tuned = _launch_shapes.get(layer) if layer is not None else None
    return tuned is None or tuned.get("kernel", "wide") == "wide"


def layer_key(hk: int, hv: int, dk: int, dv: int, state_dtype: torch.dtype) -> tuple:
    """What a launch shape is chosen for: the layer's heads, head dims and state dtype."""
    return (hk, hv, dk, dv, state_dtype)


def rule_config(dk: int, dv: int) -> dict:
    """The launch shape without a timing: tiles of 4,096 state values (16 KiB in fp32, 8 KiB in
    bf16), at least 16 columns, at 4 warps, the next tile prefetched. At Qwen3.5-4B sizes for
    sm_90 (ptxas, Triton 3.9): 155 registers a thread with an fp32 state (3 programs a
    multiprocessor), 120 with bf16 (4)."""
    block_k, block_dv = triton.next_power_of_2(dk), triton.next_power_of_2(dv)
    block_v = min(block_dv, max(16, 4096 // block_k))
    return {"kernel": "wide", "block_v": block_v, "num_warps": 4, "prefetch": True}


def launch_candidates(dk: int, dv: int) -> list[dict]:
    """The launch shapes worth timing, the rule's first: the rule without the prefetch, at 8
    warps, with tiles of half its columns (4 warps) and of twice (8 warps). Registers a thread
    at Qwen3.5-4B sizes with an fp32 / bf16 state (sm_90): 113 / 95, 102 / 64, 80 / 72,
    154 / 117."""
    block_dv = triton.next_power_of_2(dv)
    rule = rule_config(dk, dv)
    shapes = [rule, {**rule, "prefetch": False}, {**rule, "num_warps": 8}]
    for block_v, warps in ((rule["block_v"] // 2, 4), (rule["block_v"] * 2, 8)):
        if 16 <= block_v <= block_dv:
            shapes.append({**rule, "block_v": block_v, "num_warps": warps})
    return [c for i, c in enumerate(shapes) if c not in shapes[:i]]


# Launch shapes timed at start-up, by `layer_key`; {"kernel": "split"} where gdn_decode.py's
# kernel won.
_launch_shapes: dict[tuple, dict] = {}


def launch_config(layer: tuple) -> dict:
    """The wide kernel's launch shape for a layer (`layer_key`): what `set_launch_shape` gave
    it, else the rule."""
    tuned = _launch_shapes.get(layer)
    if tuned is not None and tuned.get("kernel", "wide") == "wide":
        return dict(tuned)
    return rule_config(layer[2], layer[3])


def set_launch_shape(layer: tuple, config: dict | None) -> None:
    """Use `config` (one of `launch_candidates`, or {"kernel": "split"}) for every later launch
    on layers of this `layer_key` at batches that fill the GPU; None goes back to the rule."""
    if config is None:
        _launch_shapes.pop(layer, None)
    else:
        _launch_shapes[layer] = dict(config)

"""Triton depthwise causal conv1d over packed sequences, with a per-slot rolling input state
(the short conv in front of Gated DeltaNet). Two launches: the conv, which reads each slot's
old state for the first W-1 taps of a sequence, then the state update, which overwrites the
slots; stream order makes the second see nothing the first still needs."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv1d_kernel(
    x_ptr, weight_ptr, bias_ptr, state_ptr, out_ptr, seq_of_token_ptr, query_start_loc_ptr,
    slot_ids_ptr, has_initial_state_ptr, num_tokens, dim, x_stride, out_stride, state_stride_s,
    state_stride_d, state_stride_w, WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    t_ok = t < num_tokens
    d_ok = d < dim
    seq = tl.load(seq_of_token_ptr + t, mask=t_ok, other=0)
    start = tl.load(query_start_loc_ptr + seq, mask=t_ok, other=0)
    slot = tl.load(slot_ids_ptr + seq, mask=t_ok, other=-1)
    resume = tl.load(has_initial_state_ptr + seq, mask=t_ok, other=0) != 0
    real = t_ok & (slot >= 0)
    state_row = state_ptr + slot.to(tl.int64)[:, None] * state_stride_s
    state_row += d[None, :].to(tl.int64) * state_stride_d
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for w in tl.static_range(WIDTH):
        src = t - (WIDTH - 1) + w  # the input this tap reads, as a token index
        in_seq = src >= start
        m = (real & in_seq)[:, None] & d_ok[None, :]
        xv = tl.load(x_ptr + src.to(tl.int64)[:, None] * x_stride + d[None, :], mask=m, other=0.0)
        # Before the sequence's first token: the slot's history, newest last (index W-2).
        hist = (WIDTH - 1) + (src - start)
        mh = (real & ~in_seq & resume)[:, None] & d_ok[None, :]
        hv = tl.load(state_row + hist[:, None] * state_stride_w, mask=mh, other=0.0)
        wv = tl.load(weight_ptr + d * WIDTH + w, mask=d_ok, other=0.0).to(tl.float32)
        acc += (xv.to(tl.float32) + hv.to(tl.float32)) * wv[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    acc = tl.where(real[:, None], acc, 0.0)
    out = out_ptr + t.to(tl.int64)[:, None] * out_stride + d[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & d_ok[None, :])


@triton.jit
def _conv1d_state_kernel(
    x_ptr, state_ptr, query_start_loc_ptr, slot_ids_ptr, has_initial_state_ptr, dim, x_stride,
    state_stride_s, state_stride_d, state_stride_w, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    start = tl.load(query_start_loc_ptr + b)
    length = tl.load(query_start_loc_ptr + b + 1) - start
    slot = tl.load(slot_ids_ptr + b)
    resume = tl.load(has_initial_state_ptr + b) != 0
    j = tl.arange(0, BLOCK_W)  # new state position, oldest first
    idx = length + j  # its position in [old state (W-1) ; x (length)]
    # Scalar conditions fold into the bounds (the interpreter rejects block & scalar masks).
    rows_kept = tl.where((slot >= 0) & (length > 0), WIDTH - 1, 0)
    keep = (j < rows_kept)[:, None] & (d < dim)[None, :]
    from_x = (idx >= WIDTH - 1)[:, None]
    from_old = (idx < tl.where(resume, WIDTH - 1, 0))[:, None]
    row = state_ptr + slot.to(tl.int64) * state_stride_s + d[None, :].to(tl.int64) * state_stride_d
    src_x = x_ptr + (start + idx - (WIDTH - 1)).to(tl.int64)[:, None] * x_stride + d[None, :]
    xv = tl.load(src_x, mask=keep & from_x, other=0.0)
    old = tl.load(row + idx[:, None] * state_stride_w, mask=keep & from_old, other=0.0)
    new = tl.where(from_x, xv.to(tl.float32), old.to(tl.float32))
    tl.store(row + j[:, None] * state_stride_w, new.to(state_ptr.dtype.element_ty), mask=keep)


@triton.jit
def _conv1d_verify_state_kernel(
    x_ptr, state_ptr, query_start_loc_ptr, slots_ptr, has_initial_state_ptr, dim, x_stride,
    state_stride_s, state_stride_d, state_stride_w, WIDTH: tl.constexpr, NUM_OUT: tl.constexpr,
    BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """The window after each token j < NUM_OUT of sequence b into slot slots[b, j]: the last W-1
    inputs of [old window (slot slots[b, 0]) ; x_b[: j + 1]]. Windows j >= 1 first, then a
    barrier, then window 0, which overwrites the slot the others read."""
    b = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    start = tl.load(query_start_loc_ptr + b)
    length = tl.load(query_start_loc_ptr + b + 1) - start
    read = tl.load(slots_ptr + b * NUM_OUT)
    resume = tl.load(has_initial_state_ptr + b) != 0
    w = tl.arange(0, BLOCK_W)
    d_ok = (d < dim)[None, :]
    old_row = (
        state_ptr + read.to(tl.int64) * state_stride_s + d[None, :].to(tl.int64) * state_stride_d
    )
    first = tl.zeros((BLOCK_W, BLOCK_D), dtype=tl.float32)
    for jj in tl.static_range(NUM_OUT):
        j = NUM_OUT - 1 - jj
        to = tl.load(slots_ptr + b * NUM_OUT + j)
        rows = tl.where((read >= 0) & (to >= 0) & (j < length), WIDTH - 1, 0)
        keep = (w < rows)[:, None] & d_ok
        idx = j + 1 + w  # position in [old window (W-1) ; x]
        from_x = (idx >= WIDTH - 1)[:, None]
        from_old = (idx < tl.where(resume, WIDTH - 1, 0))[:, None]
        src_x = x_ptr + (start + idx - (WIDTH - 1)).to(tl.int64)[:, None] * x_stride + d[None, :]
        xv = tl.load(src_x, mask=keep & from_x, other=0.0)
        old = tl.load(old_row + idx[:, None] * state_stride_w, mask=keep & from_old, other=0.0)
        new = tl.where(from_x, xv.to(tl.float32), old.to(tl.float32))
        if j == 0:
            first = new
        else:
            row = state_ptr + to.to(tl.int64) * state_stride_s
            row += d[None, :].to(tl.int64) * state_stride_d
            tl.store(
                row + w[:, None] * state_stride_w, new.to(state_ptr.dtype.element_ty), mask=keep
            )
    tl.debug_barrier()
    to0 = tl.where(length > 0, read, -1)
    keep0 = (w < tl.where(to0 >= 0, WIDTH - 1, 0))[:, None] & d_ok
    tl.store(
        old_row + w[:, None] * state_stride_w, first.to(state_ptr.dtype.element_ty), mask=keep0
    )


def _conv(x, weight, bias, conv_state, query_start_loc, read_slots, resume, activation):
    """The conv launch: y for every token, each sequence's window read from its slot in
    `read_slots` (nothing written). Returns (y, the launch's block of channels)."""
    if x.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError("causal_conv1d_ needs x with contiguous rows and a contiguous weight")
    num_tokens, dim = x.shape
    out = torch.empty((num_tokens, dim), dtype=x.dtype, device=x.device)
    s0, s1, s2 = conv_state.stride()
    block_d = min(256, triton.next_power_of_2(dim))
    if num_tokens:
        # Each token's sequence, found on the device so the launch needs no host sync.
        positions = torch.arange(num_tokens, device=x.device, dtype=torch.int32)
        seq_of_token = torch.searchsorted(query_start_loc[1:], positions, right=True)
        seq_of_token = seq_of_token.to(torch.int32)
        block_t = min(16, triton.next_power_of_2(num_tokens))
        grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(dim, block_d))
        _conv1d_kernel[grid](
            x, weight, bias if bias is not None else weight, conv_state, out, seq_of_token,
            query_start_loc, read_slots, resume, num_tokens, dim, x.stride(0), out.stride(0),
            s0, s1, s2, WIDTH=weight.shape[1], HAS_BIAS=bias is not None,
            SILU=activation == "silu", BLOCK_T=block_t, BLOCK_D=block_d, num_warps=4,
        )  # fmt: skip
    return out, block_d


def causal_conv1d_(
    x, weight, bias, conv_state, query_start_loc, slot_ids, has_initial_state, activation='silu',
):  # fmt: skip
    """See `atom_kernels.ops.causal_conv1d_`. No host syncs (CUDA-graph capturable)."""
    resume = has_initial_state.view(torch.uint8)
    out, block_d = _conv(x, weight, bias, conv_state, query_start_loc, slot_ids, resume, activation)
    width, dim = weight.shape[1], x.shape[1]
    if slot_ids.shape[0]:
        _conv1d_state_kernel[(slot_ids.shape[0], triton.cdiv(dim, block_d))](
            x, conv_state, query_start_loc, slot_ids, resume, dim, x.stride(0),
            *conv_state.stride(), WIDTH=width, BLOCK_W=triton.next_power_of_2(width - 1),
            BLOCK_D=block_d, num_warps=4,
        )  # fmt: skip
    return out


def causal_conv1d_verify_(
    x, weight, bias, conv_state, query_start_loc, slots, has_initial_state, activation='silu',
):  # fmt: skip
    """See `atom_kernels.ops.causal_conv1d_verify_`. No host syncs (CUDA-graph capturable):
    the conv reading each row's slot slots[b, 0], then the per-token windows."""
    resume = has_initial_state.view(torch.uint8)
    read = slots[:, 0].contiguous()
    out, block_d = _conv(x, weight, bias, conv_state, query_start_loc, read, resume, activation)
    width, dim = weight.shape[1], x.shape[1]
    if slots.shape[0]:
        _conv1d_verify_state_kernel[(slots.shape[0], triton.cdiv(dim, block_d))](
            x, conv_state, query_start_loc, slots, resume, dim, x.stride(0), *conv_state.stride(),
            WIDTH=width, NUM_OUT=slots.shape[1], BLOCK_W=triton.next_power_of_2(width - 1),
            BLOCK_D=block_d, num_warps=4,
        )  # fmt: skip
    return out

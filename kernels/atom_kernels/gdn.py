"""Triton Gated DeltaNet (the linear attention of Qwen3-Next / Qwen3.5) over packed sequences
with slot-indexed recurrent states, updated in place.

`gated_delta_rule_recurrent_` walks each sequence token by token: one program per (sequence,
v head, block of Dv columns) keeps its `[Dk, BLOCK_V]` slice of the state in registers for the
whole sequence, so the state is read and written once per call. This is the decode kernel
(one token per row).

`gated_delta_rule_chunked_` is the prefill kernel: the same program layout, 16 tokens a step,
the step's rank-1 updates folded into one triangular solve and matmuls. On a GPU with fla-core
installed, prefill goes to fla's chunked kernels instead (`gated_delta_rule_chunked_fla_`),
whose work is spread over chunks as well as heads.

`gdn_gating` turns the projection's a and b columns into the fp32 log decay g and write
strength beta those kernels take, in one launch (`gdn_gates` is its math, shared with the
fused decode step in `gdn_decode.py`).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from atom_kernels import envs


def _gdn_dims(q, k, v, g, beta, state) -> tuple[int, int, int, int]:
    """(k heads, k head dim, v heads, v head dim) of a delta-rule call, the layouts the kernels
    read checked: a contiguous last dim of q, k, v and the state, contiguous g and beta rows."""
    for name, t in (("q", q), ("k", k), ("v", v), ("state", state)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dim")
    if g.stride(1) != 1 or beta.stride(1) != 1:
        raise ValueError("g and beta need contiguous rows")
    return q.shape[1], q.shape[2], v.shape[1], v.shape[2]


def _rule_args(q, k, v, g, beta, state, out, query_start_loc, slot_ids, has_initial_state, scale):
    """The arguments both delta-rule kernels start with: the tensors, the scale, their strides."""
    return (
        q, k, v, g, beta, state, out, query_start_loc, slot_ids,
        has_initial_state.view(torch.uint8), scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), beta.stride(0), out.stride(0), out.stride(1),
        state.stride(0), state.stride(1), state.stride(2),
    )  # fmt: skip


@triton.jit
def gdn_gates(a, b, a_log, dt_bias):
    """(g, beta) = (-exp(a_log) * softplus(a + dt_bias), sigmoid(b)) in fp32, elementwise.
    softplus as torch's: the identity above 20, else log1p(exp(x)), with log1p(y) computed as
    log(u) * y / (u - 1), u = 1 + y (exact to a few ulps where log(1 + y) loses y's digits)."""
    x = a.to(tl.float32) + dt_bias.to(tl.float32)
    y = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + y
    log1p = tl.where(u == 1.0, y, tl.log(u) * (y / tl.where(u == 1.0, 1.0, u - 1.0)))
    softplus = tl.where(x > 20.0, x, log1p)
    g = -tl.exp(a_log.to(tl.float32)) * softplus
    beta = 1.0 / (1.0 + tl.exp(-b.to(tl.float32)))
    return g, beta


@triton.jit
def _gdn_gating_kernel(
    a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, g_ptr, beta_ptr, num_tokens, a_stride, b_stride,
    HV: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.arange(0, BLOCK_H)
    h_ok = h < HV
    m = (t < num_tokens)[:, None] & h_ok[None, :]
    t64 = t.to(tl.int64)[:, None]
    a = tl.load(a_ptr + t64 * a_stride + h[None, :], mask=m, other=0.0)
    b = tl.load(b_ptr + t64 * b_stride + h[None, :], mask=m, other=0.0)
    a_log = tl.load(a_log_ptr + h, mask=h_ok, other=0.0)
    dt_bias = tl.load(dt_bias_ptr + h, mask=h_ok, other=0.0)
    g, beta = gdn_gates(a, b, a_log[None, :], dt_bias[None, :])
    tl.store(g_ptr + t64 * HV + h[None, :], g, mask=m)
    tl.store(beta_ptr + t64 * HV + h[None, :], beta, mask=m)


def gdn_gating(a, b, a_log, dt_bias):
    """See `atom_kernels.ops.gdn_gating`. No host syncs."""
    if not (a_log.is_contiguous() and dt_bias.is_contiguous()):
        raise ValueError("gdn_gating needs contiguous a_log and dt_bias")
    num_tokens, hv = a.shape
    g = torch.empty((num_tokens, hv), dtype=torch.float32, device=a.device)
    beta = torch.empty_like(g)
    if num_tokens:
        block_h = triton.next_power_of_2(hv)
        block_t = max(1, min(64, 2048 // block_h, triton.next_power_of_2(num_tokens)))
        _gdn_gating_kernel[(triton.cdiv(num_tokens, block_t),)](
            a, b, a_log, dt_bias, g, beta, num_tokens, a.stride(0), b.stride(0),
            HV=hv, BLOCK_T=block_t, BLOCK_H=block_h, num_warps=4,
        )  # fmt: skip
    return g, beta


@triton.jit
def _gdn_recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, query_start_loc_ptr, slot_ids_ptr,
    has_initial_state_ptr, scale, q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t,
    v_stride_h, g_stride_t, beta_stride_t, out_stride_t, out_stride_h, state_stride_s,
    state_stride_h, state_stride_k, out_slots_ptr, DK: tl.constexpr, DV: tl.constexpr,
    GROUP: tl.constexpr, L2NORM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    PER_TOKEN: tl.constexpr, NUM_OUT: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    kh = h // GROUP
    dk = tl.arange(0, BLOCK_K)
    dv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = dv < DV
    start = tl.load(query_start_loc_ptr + b)
    end = tl.load(query_start_loc_ptr + b + 1)
    if PER_TOKEN:  # a verify step: read slots[b, 0], keep the state after token j in slots[b, j]
        slot = tl.load(out_slots_ptr + b * NUM_OUT)
    else:
        slot = tl.load(slot_ids_ptr + b)
    real = slot >= 0
    resume = tl.load(has_initial_state_ptr + b) != 0
    # Scalar conditions fold into the bounds (the interpreter rejects block & scalar masks).
    k_real = dk < tl.where(real, DK, 0)
    v_real = dv < tl.where(real, DV, 0)
    k_resume = dk < tl.where(real & resume, DK, 0)
    k_write = dk < tl.where(real & (end > start), DK, 0)
    s_ptrs = state_ptr + slot.to(tl.int64) * state_stride_s + h * state_stride_h
    s_ptrs += dk[:, None] * state_stride_k + dv[None, :]
    s = tl.load(s_ptrs, mask=k_resume[:, None] & v_ok[None, :], other=0.0).to(tl.float32)
    first = start.to(tl.int64)
    for i in range(0, end - start):
        t64 = first + i
        q = tl.load(q_ptr + t64 * q_stride_t + kh * q_stride_h + dk, mask=k_real, other=0.0)
        k = tl.load(k_ptr + t64 * k_stride_t + kh * k_stride_h + dk, mask=k_real, other=0.0)
        v = tl.load(v_ptr + t64 * v_stride_t + h * v_stride_h + dv, mask=v_real, other=0.0)
        q = q.to(tl.float32)
        k = k.to(tl.float32)
        if L2NORM:
            q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6)
            k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
        q = q * scale
        decay = tl.exp(tl.load(g_ptr + t64 * g_stride_t + h).to(tl.float32))
        beta = tl.load(beta_ptr + t64 * beta_stride_t + h).to(tl.float32)
        s = s * decay
        predicted = tl.sum(k[:, None] * s, axis=0)
        delta = beta * (v.to(tl.float32) - predicted)
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(q[:, None] * s, axis=0)
        o = tl.where(real, o, 0.0)
        o_ptrs = out_ptr + t64 * out_stride_t + h * out_stride_h + dv
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=v_ok)
        if PER_TOKEN:
            to = tl.load(out_slots_ptr + b * NUM_OUT + tl.minimum(i, NUM_OUT - 1))
            k_keep = dk < tl.where(real & (to >= 0) & (i < NUM_OUT), DK, 0)
            t_ptrs = state_ptr + to.to(tl.int64) * state_stride_s + h * state_stride_h
            t_ptrs += dk[:, None] * state_stride_k + dv[None, :]
            tl.store(t_ptrs, s.to(state_ptr.dtype.element_ty), mask=k_keep[:, None] & v_ok[None, :])
            # The next token starts from the state as stored (a half-precision state rounds
            # here), as the plain decode step after this token would: drafts change no output.
            s = s.to(state_ptr.dtype.element_ty).to(tl.float32)
    if not PER_TOKEN:
        tl.store(s_ptrs, s.to(state_ptr.dtype.element_ty), mask=k_write[:, None] & v_ok[None, :])


def gated_delta_rule_recurrent_(
    q, k, v, g, beta, state, query_start_loc, slot_ids, has_initial_state, scale,
    use_qk_l2norm=True, out=None, out_slots=None,
):  # fmt: skip
    """See `atom_kernels.ops.gated_delta_rule_`; token-by-token for every row. No host syncs
    (CUDA-graph capturable). With `out_slots` ([B, W], `ops.gated_delta_rule_verify_`) each
    row reads slot out_slots[b, 0] and leaves its state after token j in out_slots[b, j]."""
    hk, dk, hv, dv = _gdn_dims(q, k, v, g, beta, state)
    if out is None:
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    batch = slot_ids.shape[0]
    if batch == 0:
        return out
    block_k = triton.next_power_of_2(dk)
    # Keep the state slice at ~4K fp32 values per program (registers), at least 16 columns.
    block_v = max(16, min(triton.next_power_of_2(dv), 4096 // block_k))
    grid = (batch, hv, triton.cdiv(dv, block_v))
    _gdn_recurrent_kernel[grid](
        *_rule_args(q, k, v, g, beta, state, out, query_start_loc, slot_ids, has_initial_state,
                    scale),
        out_slots if out_slots is not None else slot_ids,
        DK=dk, DV=dv, GROUP=hv // hk, L2NORM=use_qk_l2norm, BLOCK_K=block_k, BLOCK_V=block_v,
        PER_TOKEN=out_slots is not None,
        NUM_OUT=out_slots.shape[1] if out_slots is not None else 1,
        num_warps=4,
    )  # fmt: skip
    return out


@triton.jit
def _gdn_chunk_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, query_start_loc_ptr, slot_ids_ptr,
    has_initial_state_ptr, scale, q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t,
    v_stride_h, g_stride_t, beta_stride_t, out_stride_t, out_stride_h, state_stride_s,
    state_stride_h, state_stride_k, DK: tl.constexpr, DV: tl.constexpr, GROUP: tl.constexpr,
    L2NORM: tl.constexpr, IEEE: tl.constexpr, BT: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):  # fmt: skip
    """One (sequence, v head, Dv tile) per program, BT tokens at a time: within a chunk the BT
    rank-1 updates become one unit-lower-triangular system (inverted by forward substitution
    on a BT x BT tile), so the rest is matmuls; the state slice stays in registers."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    kh = h // GROUP
    dk = tl.arange(0, BLOCK_K)
    dv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    rows = tl.arange(0, BT)
    v_ok = dv < DV
    start = tl.load(query_start_loc_ptr + b)
    end = tl.load(query_start_loc_ptr + b + 1)
    slot = tl.load(slot_ids_ptr + b)
    real = slot >= 0
    resume = tl.load(has_initial_state_ptr + b) != 0
    k_real = dk < tl.where(real, DK, 0)
    k_resume = dk < tl.where(real & resume, DK, 0)
    k_write = dk < tl.where(real & (end > start), DK, 0)
    s_ptrs = state_ptr + slot.to(tl.int64) * state_stride_s + h * state_stride_h
    s_ptrs += dk[:, None] * state_stride_k + dv[None, :]
    s = tl.load(s_ptrs, mask=k_resume[:, None] & v_ok[None, :], other=0.0).to(tl.float32)
    strictly_lower = rows[:, None] > rows[None, :]
    causal = rows[:, None] >= rows[None, :]
    first = start.to(tl.int64)
    for c in range(0, tl.cdiv(end - start, BT)):
        t0 = first + c * BT
        t = t0 + rows
        in_seq = rows < end - t0  # rows of this chunk inside the sequence
        t_real = rows < tl.where(real, end - t0, 0)
        km = t_real[:, None] & k_real[None, :]
        kk = tl.load(
            k_ptr + t[:, None] * k_stride_t + kh * k_stride_h + dk[None, :], mask=km, other=0.0
        )
        qq = tl.load(
            q_ptr + t[:, None] * q_stride_t + kh * q_stride_h + dk[None, :], mask=km, other=0.0
        )
        vm = t_real[:, None] & v_ok[None, :]
        vv = tl.load(
            v_ptr + t[:, None] * v_stride_t + h * v_stride_h + dv[None, :], mask=vm, other=0.0
        )
        # Rows past the sequence: k = v = 0, beta = 0 and g = 0, so they change nothing.
        gg = tl.load(g_ptr + t * g_stride_t + h, mask=t_real, other=0.0).to(tl.float32)
        bb = tl.load(beta_ptr + t * beta_stride_t + h, mask=t_real, other=0.0).to(tl.float32)
        kk = kk.to(tl.float32)
        qq = qq.to(tl.float32)
        vv = vv.to(tl.float32)
        if L2NORM:
            kk = kk * tl.rsqrt(tl.sum(kk * kk, axis=1) + 1e-6)[:, None]
            qq = qq * tl.rsqrt(tl.sum(qq * qq, axis=1) + 1e-6)[:, None]
        qq = qq * scale
        gc = tl.cumsum(gg, axis=0)  # log decay from the chunk start through each row
        g_last = tl.sum(tl.where(rows == BT - 1, gc, 0.0), axis=0)
        decay = tl.where(causal, tl.exp(tl.where(causal, gc[:, None] - gc[None, :], 0.0)), 0.0)
        kb = kk * bb[:, None]
        if IEEE:
            a = tl.dot(kb, tl.trans(kk), input_precision="ieee")
        else:
            a = tl.dot(kb, tl.trans(kk))
        a = tl.where(strictly_lower, a * decay, 0.0)
        # inv = (I + a)^-1 row by row: inv_i = e_i - sum_{j<i} a_ij inv_j.
        inv = tl.zeros((BT, BT), dtype=tl.float32)
        for i in range(BT):
            a_i = tl.sum(tl.where(rows[:, None] == i, a, 0.0), axis=0)
            inv_i = tl.where(rows == i, 1.0, -tl.sum(a_i[:, None] * inv, axis=0))
            inv = tl.where(rows[:, None] == i, inv_i[None, :], inv)
        if IEEE:
            w = tl.dot(inv, kb * tl.exp(gc)[:, None], input_precision="ieee")
            u = tl.dot(inv, vv * bb[:, None], input_precision="ieee")
            u = u - tl.dot(w, s, input_precision="ieee")
            scores = tl.dot(qq, tl.trans(kk), input_precision="ieee") * decay
            o = tl.dot(qq * tl.exp(gc)[:, None], s, input_precision="ieee")
            o += tl.dot(scores, u, input_precision="ieee")
            k_end = kk * tl.exp(g_last - gc)[:, None]
            s = s * tl.exp(g_last) + tl.dot(tl.trans(k_end), u, input_precision="ieee")
        else:
            w = tl.dot(inv, kb * tl.exp(gc)[:, None])
            u = tl.dot(inv, vv * bb[:, None]) - tl.dot(w, s)
            scores = tl.dot(qq, tl.trans(kk)) * decay
            o = tl.dot(qq * tl.exp(gc)[:, None], s) + tl.dot(scores, u)
            k_end = kk * tl.exp(g_last - gc)[:, None]
            s = s * tl.exp(g_last) + tl.dot(tl.trans(k_end), u)
        o_ptrs = out_ptr + t[:, None] * out_stride_t + h * out_stride_h + dv[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=in_seq[:, None] & v_ok[None, :])
    tl.store(s_ptrs, s.to(state_ptr.dtype.element_ty), mask=k_write[:, None] & v_ok[None, :])


def gated_delta_rule_chunked_(
    q, k, v, g, beta, state, query_start_loc, slot_ids, has_initial_state, scale,
    use_qk_l2norm=True, *, chunk=16,
):  # fmt: skip
    """See `atom_kernels.ops.gated_delta_rule_`: the chunked kernel (16 tokens a step) for
    every row. No host syncs.

    The chunk is 16 because the forward substitution is sequential in the chunk's rows, each
    row a reduction over the whole chunk x chunk tile: on an H200 (bf16, 32 v heads of 128,
    `benchmarks/gdn_prefill_bench.py`, us a layer) 15 decode rows + one 500-token row ran 563 /
    1,324 / 2,562 at chunks 16 / 32 / 64 (fla-core 2,692), 8 rows of 1,024 4,068 / 8,028 / 11,552
    (fla 3,071), one 4,096-token row 2,021 / 4,025 / 5,508 (fla 2,716)."""
    hk, dk, hv, dv = _gdn_dims(q, k, v, g, beta, state)
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    batch = slot_ids.shape[0]
    if batch == 0:
        return out
    block_k = max(16, triton.next_power_of_2(dk))
    block_v = max(16, min(triton.next_power_of_2(dv), 32))
    grid = (batch, hv, triton.cdiv(dv, block_v))
    _gdn_chunk_kernel[grid](
        *_rule_args(q, k, v, g, beta, state, out, query_start_loc, slot_ids, has_initial_state,
                    scale),
        DK=dk, DV=dv, GROUP=hv // hk, L2NORM=use_qk_l2norm, IEEE=q.dtype == torch.float32,
        BT=chunk, BLOCK_K=block_k, BLOCK_V=block_v, num_warps=8,
    )  # fmt: skip
    return out


# Prefill kernel: "triton" (this module's, the default) or "fla" (fla-core's chunked kernels).
# fla spreads one long sequence over more programs, but each call costs ~2 ms of host time in
# its Python wrappers and syncs with the host (measured on an H200 with fla-core 0.6: 24 GDN
# layers added ~49 ms to every step that prefills, and a step with 15 decodes and a 500-token
# chunk took ~95 ms), so it only pays for very long single prompts. Read once at import.
PREFILL_KERNEL = envs.GDN_PREFILL.value()


@functools.cache
def _fla_chunk():
    """fla-core's chunked gated delta rule, or None when it is not installed."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


def gated_delta_rule_chunked_fla_(
    q, k, v, g, beta, state, query_start_loc, slot_ids, has_initial_state, scale,
    use_qk_l2norm=True,
):  # fmt: skip
    """The prefill path through fla-core's chunked kernels (GPU only): the slots' states are
    gathered into fla's `[B, Hv, Dk, Dv]` fp32 initial states (zeros where a row does not
    resume), fla runs every row of the varlen batch, and the final states are scattered back
    to the real rows' slots."""
    chunk = _fla_chunk()
    if chunk is None:
        raise RuntimeError("fla-core is not installed (pip install fla-core)")
    group = v.shape[1] // k.shape[1]
    if group > 1:  # fla wants one q/k head per v head
        q = q.repeat_interleave(group, dim=1)
        k = k.repeat_interleave(group, dim=1)
    real = slot_ids >= 0
    slots = slot_ids.clamp(min=0).long()
    keep = (real & has_initial_state).to(torch.float32)[:, None, None, None]
    initial = state[slots].to(torch.float32) * keep
    out, final = chunk(
        q[None], k[None], v[None], g[None], beta[None].to(q.dtype), scale=scale,
        initial_state=initial, output_final_state=True, cu_seqlens=query_start_loc.long(),
        use_qk_l2norm_in_kernel=use_qk_l2norm,
    )  # fmt: skip
    out = out[0]
    # Padding rows: zero output, state untouched; rows without tokens: state untouched.
    lengths = query_start_loc[1:] - query_start_loc[:-1]
    rows_real = torch.repeat_interleave(real, lengths, output_size=out.shape[0])
    out = out * rows_real[:, None, None].to(out.dtype)
    # fla's varlen path syncs with the host anyway (its chunk index), so this one costs little.
    written = torch.nonzero(real & (lengths > 0)).squeeze(1)
    state[slot_ids[written].long()] = final[written].to(state.dtype)
    return out.to(v.dtype)


def gated_delta_rule_(
    q, k, v, g, beta, state, query_start_loc, slot_ids, has_initial_state, scale,
    use_qk_l2norm=True,
):  # fmt: skip
    """See `atom_kernels.ops.gated_delta_rule_`. A batch of one token per row (decided from
    shapes, no host sync) runs the recurrent kernel; a batch with longer rows runs this module's
    chunked kernel, or fla-core's on a GPU with `ATOM_GDN_PREFILL=fla` and fla-core installed."""
    args = (q, k, v, g, beta, state, query_start_loc, slot_ids, has_initial_state, scale)
    if q.shape[0] <= slot_ids.shape[0]:
        return gated_delta_rule_recurrent_(*args, use_qk_l2norm)
    if PREFILL_KERNEL == "fla" and q.is_cuda and _fla_chunk() is not None:
        return gated_delta_rule_chunked_fla_(*args, use_qk_l2norm)
    return gated_delta_rule_chunked_(*args, use_qk_l2norm)


def gated_delta_rule_verify_(
    q, k, v, g, beta, state, query_start_loc, slots, has_initial_state, scale, use_qk_l2norm=True,
):  # fmt: skip
    """See `atom_kernels.ops.gated_delta_rule_verify_`: the recurrent kernel, keeping the state
    after every token of a row in its slot. No host syncs (CUDA-graph capturable)."""
    return gated_delta_rule_recurrent_(
        q, k, v, g, beta, state, query_start_loc, slots[:, 0].contiguous(), has_initial_state,
        scale, use_qk_l2norm, out_slots=slots,
    )  # fmt: skip

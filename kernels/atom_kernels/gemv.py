"""Triton matrix-vector product for decode at batch 1: y = x @ W.T (+ bias) with x [1, K].

At one row the projection is a pure weight read, so the kernel is built for bandwidth: each
program owns BLOCK_N output features and streams their [BLOCK_N, K] weight rows once,
BLOCK_K columns at a time, multiplying by the matching slice of x and keeping a
[BLOCK_N, BLOCK_K] fp32 accumulator that is reduced across K only once at the end. When
N / BLOCK_N programs would leave multiprocessors idle (narrow outputs such as the down
projection), K is split as well: each split writes an fp32 partial row, and the last split of
each column block to finish sums them and rounds to the output dtype (`atom_kernels.tickets`;
`merge="kernel"` uses a second tiny kernel instead, as does a launch whose counters could not
be set up during CUDA-graph capture).

`act="silu_mul"` applies SwiGLU to the output of the gate_up projection: W is [gate; up]
(2I rows) and the result is silu(gate) * up, [1, I]. Each program streams the I-th-apart row
pairs for its BLOCK_N outputs (two accumulators), rounds both sums to the output dtype (as the
separate GEMV output would be) and applies the activation in fp32 once per output, so the
activation needs no launch of its own and the [1, 2I] row is never written.

`norm_weight=` fuses the RMSNorm that precedes a projection (with the residual add when
`residual=` is given): every program first loads the whole row at once and sums its squares
(x + residual, rounded to the row's dtype, as `fused_add_rms_norm` does), then multiplies W by
the normed row, rounded to the dtype before use. The first program writes x + residual out (a
new tensor: the others still read the old residual). One launch replaces the norm's own, but
every program pays for the whole row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_kernels.decode_attention import _multiprocessor_count as _multiprocessors
from atom_kernels.tickets import ticket_counters

# Longest row the fused RMSNorm takes: it loads the whole row at once (16K elements is 64
# fp32 registers a thread at 8 warps).
MAX_NORM_ROW = 16384


@triton.jit
def _swiglu(gate, up, dtype: tl.constexpr):
    """silu(gate) * up from fp32 sums rounded to `dtype` first, as `silu_and_mul` over the
    GEMV's own output would compute it."""
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    residual_ptr,
    norm_w_ptr,
    residual_out_ptr,
    part_ptr,
    tickets_ptr,
    N,
    K,
    w_stride,
    k_per_split,
    eps,
    HAS_BIAS: tl.constexpr,
    SWIGLU: tl.constexpr,
    NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    SPLIT: tl.constexpr,
    TICKETS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
):
    # N counts the weight's rows; with SWIGLU the output has N // 2 (gate rows, then up rows).
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    if SWIGLU:
        n_out = N // 2
    else:
        n_out = N
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < n_out
    rows = w_ptr + offs_n.to(tl.int64)[:, None] * w_stride
    up_rows = w_ptr + (offs_n + n_out).to(tl.int64)[:, None] * w_stride
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    k_start = split * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    dtype = x_ptr.dtype.element_ty
    if NORM:
        # The whole row in one load (one memory round trip, not one per BLOCK_K step); the
        # first program writes x + residual out.
        # (Names differ from the loop's below: Triton would carry them into the loop.)
        first = (pid_n == 0) & (split == 0)
        row_ks = tl.arange(0, ROW_BLOCK)
        row = tl.load(x_ptr + row_ks, mask=row_ks < K, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            row_r = tl.load(residual_ptr + row_ks, mask=row_ks < K, other=0.0).to(tl.float32)
            row = (row + row_r).to(dtype)
            tl.store(residual_out_ptr + row_ks, row, mask=row_ks < tl.where(first, K, 0))
            row = row.to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(row * row, axis=0) / K + eps)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + offs_k
        k_mask = ks < k_end
        if NORM:
            v = tl.load(x_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                r = tl.load(residual_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
                v = (v + r).to(dtype).to(tl.float32)
            g = tl.load(norm_w_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
            x = (v * inv_rms * g).to(dtype).to(tl.float32)
        else:
            x = tl.load(x_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
        w_mask = n_mask[:, None] & k_mask[None, :]
        w = tl.load(rows + ks[None, :], mask=w_mask, other=0.0)
        acc += w.to(tl.float32) * x[None, :]
        if SWIGLU:
            w_up = tl.load(up_rows + ks[None, :], mask=w_mask, other=0.0)
            acc_up += w_up.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    y_up = tl.sum(acc_up, axis=1)
    if SPLIT == 1:
        if HAS_BIAS:
            y += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            if SWIGLU:
                y_up += tl.load(bias_ptr + n_out + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        if SWIGLU:
            y = _swiglu(y, y_up, out_ptr.dtype.element_ty)
        tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_mask)
    else:
        # Partial rows are [SPLIT, N] fp32: gate sums then up sums with SWIGLU.
        tl.store(part_ptr + split * N + offs_n, y, mask=n_mask)
        if SWIGLU:
            tl.store(part_ptr + split * N + n_out + offs_n, y_up, mask=n_mask)
        if TICKETS:
            # The last split of this column block to arrive sums all of them (in split order,
            # so the result does not depend on which one that is) and resets the counter.
            tl.debug_barrier()
            ticket = tl.atomic_add(tickets_ptr + pid_n, 1, sem="acq_rel")
            if ticket == SPLIT - 1:
                total = tl.zeros([BLOCK_N], dtype=tl.float32)
                total_up = tl.zeros([BLOCK_N], dtype=tl.float32)
                for s in tl.static_range(SPLIT):
                    part = part_ptr + s * N + offs_n
                    total += tl.load(part, mask=n_mask, other=0.0, cache_modifier=".cg")
                    if SWIGLU:
                        part_up = part + n_out
                        total_up += tl.load(part_up, mask=n_mask, other=0.0, cache_modifier=".cg")
                if HAS_BIAS:
                    total += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
                    if SWIGLU:
                        total_up += tl.load(bias_ptr + n_out + offs_n, mask=n_mask, other=0.0).to(
                            tl.float32
                        )
                if SWIGLU:
                    total = _swiglu(total, total_up, out_ptr.dtype.element_ty)
                tl.store(out_ptr + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_mask)
                tl.store(tickets_ptr + pid_n, 0)


@triton.jit
def _gemv_reduce_kernel(
    part_ptr,
    bias_ptr,
    out_ptr,
    N,
    HAS_BIAS: tl.constexpr,
    SWIGLU: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    if SWIGLU:
        n_out = N // 2
    else:
        n_out = N
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_out
    y = tl.zeros([BLOCK], dtype=tl.float32)
    y_up = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        y += tl.load(part_ptr + s * N + offs, mask=mask, other=0.0)
        if SWIGLU:
            y_up += tl.load(part_ptr + s * N + n_out + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if SWIGLU:
            y_up += tl.load(bias_ptr + n_out + offs, mask=mask, other=0.0).to(tl.float32)
    if SWIGLU:
        y = _swiglu(y, y_up, out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def gemv_config(n: int, k: int, multiprocessors: int) -> dict[str, int]:
    """Launch shape from the matrix shape alone (so CUDA graphs stay valid): 16 rows per
    program, 128 columns a step with 8 warps and 4 pipeline stages (the best of a 108-point
    sweep on an H200 with weights streaming from memory, `benchmarks/gemv_sweep.py`); K split
    until there are about four programs per multiprocessor, each split keeping at least 1,024
    columns."""
    block_n, block_k = 16, 128
    programs = triton.cdiv(n, block_n)
    split = 1
    while programs * split < 4 * multiprocessors and k // (split * 2) >= 1024:
        split *= 2
    return {
        "block_n": block_n,
        "block_k": block_k,
        "split": split,
        "num_warps": 8,
        "num_stages": 4,
    }


def split_k(k: int, split: int, block_k: int) -> tuple[int, int]:
    """(columns per split, splits launched) for `split` requested splits of K: each split a
    whole number of BLOCK_K steps, so fewer may be launched than asked for, none empty."""
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    return k_per_split, triton.cdiv(k, k_per_split)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    act: str | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    split: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    norm_weight: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    eps: float = 1e-6,
    merge: str = "tickets",
):
    """See `atom_kernels.ops.linear_small_m`. Keyword-only arguments override the launch
    shape (tests use them to reach the split path on small matrices). Shapes are checked by
    the caller; `act="silu_mul"` returns silu(gate) * up of the [gate; up] rows, [1, N / 2].
    With `norm_weight` (RMSNorm fused in front) returns (y, x + residual) when `residual` is
    given, else y. `merge` picks how
    split-K partial rows are summed: "tickets" (in the kernel) or "kernel" (a second launch)."""
    if merge not in ("tickets", "kernel"):
        raise ValueError(f"merge={merge!r}: expected 'tickets' or 'kernel'")
    if act not in (None, "silu_mul"):
        raise ValueError(f"act={act!r}: expected None or 'silu_mul'")
    norm = norm_weight is not None
    if norm and weight.shape[1] > MAX_NORM_ROW:
        raise ValueError(f"norm_weight: rows of {weight.shape[1]} exceed {MAX_NORM_ROW}")
    residual_out = torch.empty_like(x) if norm and residual is not None else None
    n, k = weight.shape
    swiglu = act == "silu_mul"
    n_out = n // 2 if swiglu else n
    out = torch.empty((1, n_out), dtype=x.dtype, device=x.device)
    cfg = gemv_config(n_out, k, _multiprocessors(x.device))
    block_n = block_n or cfg["block_n"]
    block_k = block_k or cfg["block_k"]
    split = split or cfg["split"]
    k_per_split, split = split_k(k, split, block_k)
    has_bias = bias is not None
    programs_n = triton.cdiv(n_out, block_n)
    parts = tickets = None
    if split > 1:
        parts = torch.empty((split, n), dtype=torch.float32, device=x.device)
        tickets = ticket_counters(x.device, programs_n) if merge == "tickets" else None
    _gemv_kernel[(programs_n, split)](
        x,
        weight,
        bias if has_bias else weight,
        out,
        residual if residual is not None else x,
        norm_weight if norm else x,
        residual_out if residual_out is not None else x,
        parts if parts is not None else out,
        tickets if tickets is not None else out,
        n,
        k,
        weight.stride(0),
        k_per_split,
        eps,
        HAS_BIAS=has_bias and (split == 1 or tickets is not None),
        SWIGLU=swiglu,
        NORM=norm,
        HAS_RESIDUAL=residual_out is not None,
        SPLIT=split,
        TICKETS=tickets is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        ROW_BLOCK=triton.next_power_of_2(k) if norm else 1,
        num_warps=num_warps or cfg["num_warps"],
        num_stages=num_stages or cfg["num_stages"],
    )
    if split > 1 and tickets is None:
        block = 1024
        _gemv_reduce_kernel[(triton.cdiv(n_out, block),)](
            parts,
            bias if has_bias else parts,
            out,
            n,
            HAS_BIAS=has_bias,
            SWIGLU=swiglu,
            SPLIT=split,
            BLOCK=block,
            num_warps=4,
        )
    return out if residual_out is None else (out, residual_out)

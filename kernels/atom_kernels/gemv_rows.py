"""Triton product of a few rows by a weight, y = x @ W.T (+ bias) with x [M, K], 2 <= M <= 16:
the verify step of speculative decoding at batch 1 (the last token and its k drafts), which
must cost close to a one-row decode step.

Like the one-row GEMV (gemv.py) it is built for bandwidth: each program streams the
[BLOCK_N, K] rows of W it owns once, BLOCK_K columns at a time, and multiplies that tile by all
M rows of x at once (`tl.dot` with the rows padded to 16, the tensor cores' smallest M), so the
weight is read once whatever M is. When the column blocks alone would leave multiprocessors
idle, K is split too: each split writes fp32 partial sums and a second small launch adds them,
adds the bias and rounds. `act="silu_mul"`: W is SwiGLU's [gate; up] and each program holds
the gate and up columns of its outputs, so the result is silu(gate) * up, both sums rounded to
the output dtype first (as `silu_and_mul` over the unfused product would see them).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

MAX_ROWS = 16
BLOCK_M = 16


@triton.jit
def _rows_kernel(
    x_ptr, w_ptr, w_up_ptr, b_ptr, out_ptr, part_ptr, m, n_out, k, k_per_split, x_stride, w_stride,
    out_stride, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr, SPLIT: tl.constexpr,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < m
    n_ok = rn < n_out
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    start = pid_k * k_per_split
    for k0 in range(start, start + k_per_split, BLOCK_K):
        cols = k0 + rk
        k_ok = cols < k
        x = tl.load(
            x_ptr + rm[:, None] * x_stride + cols[None, :],
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        w_rows = w_ptr + rn.to(tl.int64)[:, None] * w_stride + cols[None, :]
        w = tl.load(w_rows, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
        if SWIGLU:
            up = tl.load(
                w_rows + n_out.to(tl.int64) * w_stride,
                mask=n_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            if IEEE:
                acc_up += tl.dot(x, tl.trans(up), input_precision="ieee")
            else:
                acc_up += tl.dot(x, tl.trans(up))
    mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT > 1:
        part = part_ptr + (pid_k * BLOCK_M + rm)[:, None] * n_out + rn[None, :]
        tl.store(part, acc, mask=mask)
        if SWIGLU:
            tl.store(part + SPLIT * BLOCK_M * n_out, acc_up, mask=mask)
    else:
        _finish(acc, acc_up, rm, rn, mask, b_ptr, out_ptr, n_out, out_stride, HAS_BIAS, SWIGLU)


@triton.jit
def _finish(
    acc, acc_up, rm, rn, mask, b_ptr, out_ptr, n_out, out_stride, HAS_BIAS: tl.constexpr,
    SWIGLU: tl.constexpr,
):  # fmt: skip
    """Bias, the activation and the store, from fp32 sums; values rounded to the output dtype
    where the unfused path would hold them in memory."""
    dtype = out_ptr.dtype.element_ty
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < n_out, other=0.0).to(tl.float32)[None, :]
        if SWIGLU:
            acc_up += tl.load(b_ptr + n_out + rn, mask=rn < n_out, other=0.0).to(tl.float32)[
                None, :
            ]
    if SWIGLU:
        gate = acc.to(dtype).to(tl.float32)
        up = acc_up.to(dtype).to(tl.float32)
        acc = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + rm[:, None] * out_stride + rn[None, :], acc.to(dtype), mask=mask)


@triton.jit
def _rows_reduce_kernel(
    part_ptr, b_ptr, out_ptr, m, n_out, out_stride, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr,
    SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm < m)[:, None] & (rn < n_out)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        part = part_ptr + (s * BLOCK_M + rm)[:, None] * n_out + rn[None, :]
        acc += tl.load(part, mask=mask, other=0.0)
        if SWIGLU:
            acc_up += tl.load(part + SPLIT * BLOCK_M * n_out, mask=mask, other=0.0)
    _finish(acc, acc_up, rm, rn, mask, b_ptr, out_ptr, n_out, out_stride, HAS_BIAS, SWIGLU)


@functools.lru_cache(maxsize=64)
def rows_config(n_out: int, k: int, multiprocessors: int) -> dict[str, int]:
    """Launch shape by rule: 64 columns a program, 128 of K a step, and K split until the grid
    holds two programs a multiprocessor (each split keeping at least four steps of K)."""
    block_n, block_k = 64, 128
    blocks = triton.cdiv(n_out, block_n)
    split = 1
    while blocks * split < 2 * multiprocessors and k // (split * 2) >= 4 * block_k and split < 16:
        split *= 2
    return {"block_n": block_n, "block_k": block_k, "split": split, "num_warps": 4}


_launch_shapes: dict[tuple[int, int], dict[str, int]] = {}


def set_launch_shape(n_out: int, k: int, config: dict[str, int] | None) -> None:
    """Pin the launch shape used for this weight shape (start-up tuning); None: the rule."""
    if config is None:
        _launch_shapes.pop((n_out, k), None)
    else:
        _launch_shapes[(n_out, k)] = dict(config)


def launch_candidates(n_out: int, k: int, multiprocessors: int) -> list[dict[str, int]]:
    """The rule's shape and its neighbours, for start-up tuning."""
    base = rows_config(n_out, k, multiprocessors)
    out = [base]
    for block_n, block_k in ((32, 128), (64, 256), (128, 128)):
        for split in {base["split"], max(1, base["split"] // 2), base["split"] * 2}:
            if k // split >= block_k:
                out.append({"block_n": block_n, "block_k": block_k, "split": split, "num_warps": 4})
    return out


def linear_few_rows(x, weight, bias=None, *, act=None, config=None):
    """See `atom_kernels.ops.linear_few_rows`. No host syncs (CUDA-graph capturable)."""
    m, k = x.shape
    n = weight.shape[0]
    swiglu = act == "silu_mul"
    n_out = n // 2 if swiglu else n
    if config is None:
        config = _launch_shapes.get((n_out, k)) or rows_config(n_out, k, _multiprocessors(x.device))
    block_n, block_k, split = config["block_n"], config["block_k"], config["split"]
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)
    out = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    part = out
    if split > 1:
        part = torch.empty(
            ((2 if swiglu else 1) * split * BLOCK_M, n_out), dtype=torch.float32, device=x.device
        )
    grid = (triton.cdiv(n_out, block_n), split)
    up = weight[n_out:] if swiglu else weight
    _rows_kernel[grid](
        x, weight, up, bias if bias is not None else weight, out, part, m, n_out, k, k_per_split,
        x.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None, SWIGLU=swiglu,
        SPLIT=split, IEEE=x.dtype == torch.float32, BLOCK_M=BLOCK_M, BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=config["num_warps"],
    )  # fmt: skip
    if split > 1:
        _rows_reduce_kernel[(triton.cdiv(n_out, block_n),)](
            part, bias if bias is not None else weight, out, m, n_out, out.stride(0),
            HAS_BIAS=bias is not None, SWIGLU=swiglu, SPLIT=split, BLOCK_M=BLOCK_M,
            BLOCK_N=block_n, num_warps=4,
        )  # fmt: skip
    return out


@functools.lru_cache(maxsize=8)
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count

"""Triton matrix-vector product for decode at batch 1: y = x @ W.T (+ bias) with x [1, K].

At one row the projection is a pure weight read, so the kernel is built for bandwidth: each
program owns BLOCK_N output features and streams their [BLOCK_N, K] weight rows once,
BLOCK_K columns at a time, multiplying by the matching slice of x and keeping a
[BLOCK_N, BLOCK_K] fp32 accumulator that is reduced across K only once at the end. When
N / BLOCK_N programs would leave multiprocessors idle (narrow outputs such as the down
projection), K is split as well: each split writes an fp32 partial row and a second tiny
kernel sums the splits and rounds to the output dtype.

`act="silu_mul"` fuses SwiGLU's activation into the down projection: x is the [1, 2K]
gate_up row [gate | up] and the kernel multiplies W by silu(gate) * up, computed in fp32 and
rounded to x's dtype before use (the rounding `silu_and_mul` followed by `F.linear` applies),
without the separate launch or the intermediate row.

`norm_weight=` fuses the RMSNorm that precedes a projection (with the residual add when
`residual=` is given): every program first sums the squares of the whole row (x + residual,
rounded to the row's dtype, as `fused_add_rms_norm` does), then multiplies W by the normed
row, rounded to the dtype before use. The programs of the first column block write x +
residual out (a new tensor: the others still read the old residual). One launch replaces
the norm's own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_kernels.decode_attention import _multiprocessor_count as _multiprocessors


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    residual_ptr,
    norm_w_ptr,
    residual_out_ptr,
    N,
    K,
    w_stride,
    k_per_split,
    eps,
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,
    NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    rows = w_ptr + offs_n.to(tl.int64)[:, None] * w_stride
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    k_start = split * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    dtype = x_ptr.dtype.element_ty
    if NORM:
        squares = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + offs_k
            v = tl.load(x_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                r = tl.load(residual_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
                v = (v + r).to(dtype).to(tl.float32)
            squares += v * v
        inv_rms = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + offs_k
        k_mask = ks < k_end
        if NORM:
            v = tl.load(x_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                r = tl.load(residual_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
                v = (v + r).to(dtype)
                # Written by the first column block only (ks >= pid_n * K holds for it alone).
                tl.store(residual_out_ptr + ks, v, mask=k_mask & (ks >= pid_n * K))
                v = v.to(tl.float32)
            g = tl.load(norm_w_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
            x = (v * inv_rms * g).to(dtype).to(tl.float32)
        elif SILU_MUL:
            # x is [gate | up], K each; round like the separate silu_and_mul kernel's output.
            gate = tl.load(x_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
            up = tl.load(x_ptr + K + ks, mask=k_mask, other=0.0).to(tl.float32)
            h = gate / (1.0 + tl.exp(-gate)) * up
            x = h.to(x_ptr.dtype.element_ty).to(tl.float32)
        else:
            x = tl.load(x_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
        w = tl.load(rows + ks[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    if SPLIT == 1:
        if HAS_BIAS:
            y += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_mask)
    else:
        tl.store(out_ptr + split * N + offs_n, y, mask=n_mask)


@triton.jit
def _gemv_reduce_kernel(
    part_ptr,
    bias_ptr,
    out_ptr,
    N,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    y = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        y += tl.load(part_ptr + s * N + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
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
):
    """See `atom_kernels.ops.linear_small_m`. Keyword-only arguments override the launch
    shape (tests use them to reach the split path on small matrices). Shapes are checked by
    the caller; `act="silu_mul"` takes x as [1, 2K]. With `norm_weight` (RMSNorm fused in
    front) returns (y, x + residual) when `residual` is given, else y."""
    if act not in (None, "silu_mul"):
        raise ValueError(f"act={act!r}: expected None or 'silu_mul'")
    norm = norm_weight is not None
    if norm and act is not None:
        raise ValueError("norm_weight and act cannot be combined")
    residual_out = torch.empty_like(x) if norm and residual is not None else None
    n, k = weight.shape
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    cfg = gemv_config(n, k, _multiprocessors(x.device))
    block_n = block_n or cfg["block_n"]
    block_k = block_k or cfg["block_k"]
    split = split or cfg["split"]
    k_per_split, split = split_k(k, split, block_k)
    has_bias = bias is not None
    target = out if split == 1 else torch.empty((split, n), dtype=torch.float32, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n), split)](
        x,
        weight,
        bias if has_bias else weight,
        target,
        residual if residual is not None else x,
        norm_weight if norm else x,
        residual_out if residual_out is not None else x,
        n,
        k,
        weight.stride(0),
        k_per_split,
        eps,
        HAS_BIAS=has_bias and split == 1,
        SILU_MUL=act == "silu_mul",
        NORM=norm,
        HAS_RESIDUAL=residual_out is not None,
        SPLIT=split,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps or cfg["num_warps"],
        num_stages=num_stages or cfg["num_stages"],
    )
    if split > 1:
        block = 1024
        _gemv_reduce_kernel[(triton.cdiv(n, block),)](
            target,
            bias if has_bias else target,
            out,
            n,
            HAS_BIAS=has_bias,
            SPLIT=split,
            BLOCK=block,
            num_warps=4,
        )
    return out if residual_out is None else (out, residual_out)

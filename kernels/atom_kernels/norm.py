"""Triton RMSNorm and fused residual-add + RMSNorm, one program per row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_kernels import pdl
from atom_kernels.pdl import wait_for_inputs


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, x_stride, residual_stride, out_stride, hidden, eps,
    ADD_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:
        r_ptrs = residual_ptr + row * residual_stride + offs
        r = tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)
        # Round the sum to the residual's dtype first so the norm sees exactly what is
        # stored (what the torch reference and HF models compute).
        total = (x + r).to(residual_ptr.dtype.element_ty)
        tl.store(r_ptrs, total, mask=mask)
        x = total.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = x * inv_rms * w
    tl.store(out_ptr + row * out_stride + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    if x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        raise ValueError("rms_norm needs a contiguous last dim")
    if not weight.is_contiguous():
        raise ValueError("rms_norm needs a contiguous weight")
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)  # a view for the [T, H] inputs the runtime passes
    r2 = residual.reshape(-1, hidden) if residual is not None else x2
    if residual is not None and r2.data_ptr() != residual.data_ptr():
        raise ValueError("residual must be viewable as [T, H] to be updated in place")
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    rows = x2.shape[0]
    if rows:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(rows,)](
            x2, r2, weight, out, x2.stride(0), r2.stride(0), out.stride(0), hidden, eps,
            ADD_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
            **pdl.options(x.device),
        )  # fmt: skip
    return out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """See `atom_kernels.ops.rms_norm`."""
    return _launch(x, None, weight, eps)


def fused_add_rms_norm(x, residual, weight, eps):
    """See `atom_kernels.ops.fused_add_rms_norm`: `residual` is overwritten with x + residual."""
    return _launch(x, residual, weight, eps), residual


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr, z_ptr, weight_ptr, out_ptr, rows, x_stride, z_stride, out_stride, hidden, eps,
    BLOCK_ROWS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    wait_for_inputs(PDL)
    # Several short rows per program: Qwen3-Next normalises each 128-wide head separately.
    row = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)[:, None]
    offs = tl.arange(0, BLOCK)[None, :]
    mask = (row < rows) & (offs < hidden)
    x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + row * z_stride + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=offs < hidden, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / hidden + eps)
    y = x * inv_rms[:, None] * w * (z / (1.0 + tl.exp(-z)))
    tl.store(out_ptr + row * out_stride + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def gated_rms_norm(x, z, weight, eps):
    """See `atom_kernels.ops.gated_rms_norm`."""
    if x.stride(1) != 1 or z.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError("gated_rms_norm needs contiguous rows of x, z and a contiguous weight")
    rows, hidden = x.shape
    out = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    if rows:
        block = triton.next_power_of_2(hidden)
        block_rows = max(1, min(16, 2048 // block))
        _gated_rms_norm_kernel[(triton.cdiv(rows, block_rows),)](
            x, z, weight, out, rows, x.stride(0), z.stride(0), out.stride(0), hidden, eps,
            BLOCK_ROWS=block_rows, BLOCK=block, num_warps=4,
            **pdl.options(x.device),
        )  # fmt: skip
    return out

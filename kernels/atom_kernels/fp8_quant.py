"""Triton FP8 quantization: the in-kernel pieces every FP8 writer shares (the KV-cache stores, the
GEMV's cache epilogue) and the activation quantizers of the W8A8 GEMMs.

Quantizing x with a scale s (the dequantization multiplier, `fp8_formats`) is
`clamp(x / s, -max, max)` rounded to nearest even, with max the format's largest value; the
division is IEEE (`div_rn`) so the GPU gives the torch reference's bits. A dynamic scale is
`max(amax, 1e-12) / dynamic_quant_max` (448 e4m3fn, 224 e4m3fnuz) over the tensor, the token
(row) or the token's group of columns (1 x 128, the activation side of 128 x 128 block weights).

A scale reaches a kernel as a Python float (a constant of the launch) or as a one-element fp32
tensor (read on the device, so a CUDA graph keeps reading the current value): `scale_arg` turns
either into the kernel argument and the `IS_PTR` constexpr `load_scale` needs.

The interpreter (TRITON_INTERPRET=1, the CPU tests) converts to FP8 wrongly when rounding
carries into the exponent (31.1 -> 16 instead of 32): the CPU tests route its FP8 casts through
torch's (`exact_fp8_casts` in tests/kernels/conftest.py) and compare bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_kernels.fp8_formats import MIN_AMAX, dynamic_quant_max

# `MIN_AMAX` as the kernels read it (a jit function reads no plain globals).
_MIN_AMAX_C = tl.constexpr(MIN_AMAX)


def scale_arg(scale: torch.Tensor | float) -> tuple[torch.Tensor | float, bool]:
    """(kernel argument, IS_PTR) for a scale given as a float or a one-element fp32 tensor."""
    if isinstance(scale, torch.Tensor):
        return scale, True
    return float(scale), False


@triton.jit
def load_scale(scale, IS_PTR: tl.constexpr):
    """The scale as an fp32 scalar: read from its one-element tensor, or the float argument."""
    if IS_PTR:
        return tl.load(scale).to(tl.float32)
    else:
        return scale


@triton.jit
def fp8_max_of(dtype: tl.constexpr):
    """The largest finite value of an FP8 element type: 448 (e4m3fn), 240 (e4m3fnuz)."""
    if dtype == tl.float8e4nv:
        return 448.0
    else:
        return 240.0


@triton.jit
def quantize_fp8(x, scale, dtype: tl.constexpr):
    """fp32 x divided by `scale` (IEEE), clamped to the format's range, rounded to `dtype`."""
    m = fp8_max_of(dtype)
    return tl.clamp(tl.math.div_rn(x, scale), -m, m).to(dtype)


@triton.jit
def store_kv_fp8(ptr, x, mask, scale, IS_FP8: tl.constexpr):
    """Store x at ptr in the cache's element type: quantized with `scale` into an FP8 cache,
    a plain cast into any other (the scale is not touched then)."""
    dtype = ptr.dtype.element_ty
    if IS_FP8:
        tl.store(ptr, quantize_fp8(x.to(tl.float32), scale, dtype), mask=mask)
    else:
        tl.store(ptr, x.to(dtype), mask=mask)


@triton.jit
def _dynamic_quant_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    K,
    group,
    x_stride,
    q_stride,
    s_stride,
    qmax,
    BLOCK: tl.constexpr,
):
    # One program per (row, group of `group` columns): amax over the group, then the group
    # quantized with amax / qmax. Per token: one group of K columns.
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    start = g * group
    end = tl.minimum(K, start + group)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for c in range(start, end, BLOCK):
        cols = c + offs
        x = tl.load(x_ptr + row * x_stride + cols, mask=cols < end, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), _MIN_AMAX_C), qmax)
    tl.store(s_ptr + row * s_stride + g, scale)
    dtype = q_ptr.dtype.element_ty
    for c in range(start, end, BLOCK):
        cols = c + offs
        mask = cols < end
        x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * q_stride + cols, quantize_fp8(x, scale, dtype), mask=mask)


@triton.jit
def _static_quant_kernel(
    x_ptr, q_ptr, scale, K, x_stride, q_stride, IS_PTR: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < K
    s = load_scale(scale, IS_PTR)
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(q_ptr + row * q_stride + cols, quantize_fp8(x, s, q_ptr.dtype.element_ty), mask=mask)


def _dynamic(x: torch.Tensor, group: int, num_groups: int, fp8_dtype: torch.dtype):
    m, k = x.shape
    q = torch.empty((m, k), dtype=fp8_dtype, device=x.device)
    scale = torch.empty((m, num_groups), dtype=torch.float32, device=x.device)
    if m and k:
        block = min(triton.next_power_of_2(group), 2048)
        _dynamic_quant_kernel[(m, num_groups)](
            x, q, scale, k, group, x.stride(0), q.stride(0), scale.stride(0),
            dynamic_quant_max(fp8_dtype), BLOCK=block, num_warps=4 if block >= 512 else 1,
        )  # fmt: skip
    return q, scale


def per_token_quant_fp8(x, fp8_dtype):
    """See `atom_kernels.ops.per_token_quant_fp8`."""
    return _dynamic(x, x.shape[1], 1, fp8_dtype)


def per_token_group_quant_fp8(x, group_size, fp8_dtype):
    """See `atom_kernels.ops.per_token_group_quant_fp8`."""
    return _dynamic(x, group_size, triton.cdiv(x.shape[1], group_size), fp8_dtype)


def per_tensor_quant_fp8(x, fp8_dtype, scale=None):
    """See `atom_kernels.ops.per_tensor_quant_fp8`. A dynamic scale is torch's amax on the
    device (no host sync), then the static kernel."""
    m, k = x.shape
    if scale is None:
        amax = x.abs().amax().float() if x.numel() else x.new_zeros((), dtype=torch.float32)
        scale = (amax.clamp(min=MIN_AMAX) / dynamic_quant_max(fp8_dtype)).reshape(1)
    q = torch.empty((m, k), dtype=fp8_dtype, device=x.device)
    if m and k:
        block = min(triton.next_power_of_2(k), 1024)
        _static_quant_kernel[(m, triton.cdiv(k, block))](
            x, q, scale, k, x.stride(0), q.stride(0), IS_PTR=True, BLOCK=block,
            num_warps=4 if block >= 512 else 1,
        )  # fmt: skip
    return q, scale

"""FP8 GEMMs for many rows (prefill, batched decode): W8A8, activations quantized on the fly.

`fp8_linear` is the op (`ops.fp8_linear`): y = x W^T + b for an FP8 weight `[N, K]` and its
scale in any layout (`fp8_formats`), x in half precision. By the weight's layout:

- **block** (128 x 128, DeepSeek-V3 / Qwen3-FP8): x quantized per token group of 128 columns,
  then `w8a8_matmul`, a Triton GEMM whose K loop steps one scale group at a time and scales each
  step's fp32 product by the row's group scale times the column block's scale;
- **per channel or per tensor** (compressed-tensors FP8, `--quantization fp8`): x quantized per
  token (or with the checkpoint's static per-tensor `input_scale`), then `torch._scaled_mm`
  (cuBLASLt on Hopper, hipBLASLt on MI300) with rowwise or tensorwise scales (`scaled_mm`), or
  `w8a8_matmul` where `_scaled_mm` does not run (`scaled_mm_supported`).

`w8a8_matmul` takes every scale layout through strides: a scale that does not change along K
has K stride 0 and is applied once after the loop; one that does (groups) is applied per step,
which needs the step (BLOCK_K) to divide the group.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from atom_kernels import fp8_quant
from atom_kernels.fp8_formats import scale_layout

# torch._scaled_mm (cuBLASLt) wants K and N multiples of 16.
_SCALED_MM_ALIGN = 16


@triton.jit
def _w8a8_matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    a_s_ptr,
    b_s_ptr,
    bias_ptr,
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_cm,
    stride_as_m,
    stride_as_k,
    stride_bs_n,
    stride_bs_k,
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    K_GROUPED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SWIZZLE_M: tl.constexpr,
):
    # Programs in groups of SWIZZLE_M row tiles walk the column tiles together, so the weight
    # tiles they share stay in L2.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = SWIZZLE_M * tiles_n
    first_m = (pid // per_group) * SWIZZLE_M
    rows_in_group = tl.minimum(tiles_m - first_m, SWIZZLE_M)
    pid_m = first_m + (pid % per_group) % rows_in_group
    pid_n = (pid % per_group) // rows_in_group

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    # B is the row-major weight [N, K], read as [BLOCK_K, BLOCK_N] tiles (K contiguous: the
    # K-major operand FP8 tensor cores take).
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n.to(tl.int64)[None, :] * stride_bn + offs_k[:, None]
    a_s_rows = a_s_ptr + offs_m * stride_as_m
    b_s_cols = b_s_ptr + (offs_n // GROUP_N) * stride_bs_n
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + offs_k) < K
        a = tl.load(a_ptrs + k0, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs + k0, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if K_GROUPED:
            group = k0 // GROUP_K
            a_s = tl.load(a_s_rows + group * stride_as_k, mask=m_mask, other=0.0)
            b_s = tl.load(b_s_cols + group * stride_bs_k, mask=n_mask, other=0.0)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        else:
            acc = tl.dot(a, b, acc)
    if not K_GROUPED:
        a_s = tl.load(a_s_rows, mask=m_mask, other=0.0)
        b_s = tl.load(b_s_cols, mask=n_mask, other=0.0)
        acc = acc * a_s[:, None] * b_s[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def matmul_config(m: int) -> dict[str, int]:
    """Launch shape of `w8a8_matmul` by row count: narrow row tiles and more column tiles for
    few rows (there the weight read is the cost), 128 x 128 tiles for prefill-sized M. Starting
    points, not measured: `kernels_bench.py --sweep fp8` times them against cuBLAS."""
    if m <= 16:
        return {"block_m": 16, "block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 4}
    if m <= 64:
        return {"block_m": 64, "block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 3}
    if m <= 512:
        return {"block_m": 64, "block_n": 128, "block_k": 128, "num_warps": 4, "num_stages": 3}
    return {"block_m": 128, "block_n": 128, "block_k": 128, "num_warps": 8, "num_stages": 3}


def _scale_strides(scale: torch.Tensor, layout: str) -> tuple[int, int]:
    """(row stride, K stride) of a scale in `layout`; 0 where it does not vary."""
    if layout == "tensor":
        return 0, 0
    if layout == "channel":
        return scale.stride(0), 0
    return scale.stride(0), scale.stride(1)


def w8a8_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    block_size: tuple[int, int] | list[int] | None = None,
    *,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """`(a * scale_a) @ (b * scale_b)^T + bias` in `out_dtype`, accumulated in fp32.

    a: FP8 `[M, K]` (contiguous rows); scale_a: `[1]` per tensor, `[M, 1]` per token, or
    `[M, ceil(K / bk)]` per token group. b: the FP8 weight `[N, K]`; scale_b in its layout
    (`block_size` = (bn, bk) for blocks). Group scales on both sides must share bk, and the
    launch's BLOCK_K must divide it. `config` overrides `matmul_config` (the sweep)."""
    m, k = a.shape
    n = b.shape[0]
    if b.shape[1] != k or a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError(f"a {list(a.shape)} and b {list(b.shape)}: [M, K] and [N, K] rows")
    b_layout = scale_layout(b.shape, scale_b, block_size)
    a_block = None
    if scale_a.dim() == 2 and scale_a.shape[1] > 1:
        if b_layout != "block":
            raise ValueError("per-group activation scales go with block weight scales")
        a_block = (1, block_size[1])
    a_layout = scale_layout(a.shape, scale_a, a_block)
    cfg = dict(matmul_config(m), **(config or {}))
    grouped = a_layout == "block" or b_layout == "block"
    group_k = block_size[1] if b_layout == "block" else cfg["block_k"]
    if grouped and group_k % cfg["block_k"]:
        raise ValueError(f"block_k {cfg['block_k']} must divide the scale group {group_k}")
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return c
    sam, sak = _scale_strides(scale_a, a_layout)
    sbn, sbk = _scale_strides(scale_b, b_layout)
    grid = (triton.cdiv(m, cfg["block_m"]) * triton.cdiv(n, cfg["block_n"]),)
    _w8a8_matmul_kernel[grid](
        a, b, c, scale_a, scale_b, bias if bias is not None else c, m, n, k, a.stride(0),
        b.stride(0), c.stride(0), sam, sak, sbn, sbk,
        GROUP_N=block_size[0] if b_layout == "block" else 1, GROUP_K=group_k,
        K_GROUPED=grouped, HAS_BIAS=bias is not None, BLOCK_M=cfg["block_m"],
        BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"], SWIZZLE_M=8,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return c


@functools.lru_cache(maxsize=8)
def scaled_mm_supported(device: torch.device) -> bool:
    """Whether `torch._scaled_mm` runs FP8 on `device`: NVIDIA from sm_89 (Ada, Hopper and
    later), AMD gfx94x / gfx95x (MI300, MI355). Elsewhere `fp8_linear` takes `w8a8_matmul`."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    props = torch.cuda.get_device_properties(device)
    if torch.version.hip is not None:
        arch = getattr(props, "gcnArchName", "").split(":", 1)[0]
        return arch.startswith(("gfx94", "gfx95"))
    return (props.major, props.minor) >= (8, 9)


def scaled_mm(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
    out_dtype: torch.dtype, bias: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """`(a * scale_a) @ (b * scale_b)^T + bias` through `torch._scaled_mm`.

    a: FP8 `[M, K]` rows; scale_a `[1]` or `[M, 1]`. b: the FP8 weight `[N, K]` (row-major, so
    `b.t()` is the column-major operand cuBLASLt wants); scale_b `[1]`, `[N]` or `[N, 1]`. Both
    scales per tensor: tensorwise; otherwise rowwise (each side expanded to one scale a row /
    column, output in bf16 as rowwise requires, then cast). K or N not a multiple of 16: the
    operands are zero-padded for the call (a copy; weights loaded padded avoid it) and the
    output sliced back."""
    m, k = a.shape
    n = b.shape[0]
    tensorwise = scale_a.numel() == 1 and scale_b.numel() == 1
    pad_k = -k % _SCALED_MM_ALIGN
    pad_n = -n % _SCALED_MM_ALIGN
    if pad_k:
        a = _pad_columns(a, pad_k)
    if pad_k or pad_n:
        b = _pad_columns(b, pad_k)
        if pad_n:
            b = torch.cat([b, b.new_zeros((pad_n, b.shape[1]))])
    if tensorwise:
        sa, sb = scale_a.float().reshape(()), scale_b.float().reshape(())
        mm_dtype = out_dtype
    else:
        sa = scale_a.float().reshape(-1, 1).expand(m, 1).contiguous()
        sb = scale_b.float().reshape(1, -1).expand(1, n)
        if pad_n:
            sb = torch.cat([sb, sb.new_ones((1, pad_n))], dim=1)
        sb = sb.contiguous()
        mm_dtype = torch.bfloat16
    out = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=mm_dtype)
    if pad_n:
        out = out[:, :n]
    if bias is not None:  # after the product, in fp32 (rowwise takes no bias on every build)
        out = out.float() + bias.float()
    return out.to(out_dtype)


def _pad_columns(t: torch.Tensor, pad: int) -> torch.Tensor:
    """t `[R, C]` with `pad` zero columns appended (torch has no F.pad for FP8)."""
    out = t.new_zeros((t.shape[0], t.shape[1] + pad))
    out[:, : t.shape[1]] = t
    return out


def fp8_linear(
    x, weight, weight_scale, bias=None, *, input_scale=None, weight_block_size=None,
    use_scaled_mm=None,
):  # fmt: skip
    """See `atom_kernels.ops.fp8_linear`. `use_scaled_mm` forces (True) or avoids (False)
    `torch._scaled_mm` for per-channel and per-tensor weights (default: where supported)."""
    k = x.shape[-1]
    n = weight.shape[0]
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    if x2.shape[0] == 0:
        return x.new_empty((*x.shape[:-1], n))
    fp8 = weight.dtype
    layout = scale_layout(weight.shape, weight_scale, weight_block_size)
    if layout == "block":
        aq, a_s = fp8_quant.per_token_group_quant_fp8(x2, weight_block_size[1], fp8)
        y = w8a8_matmul(aq, weight, a_s, weight_scale, x.dtype, bias, weight_block_size)
        return y.reshape(*x.shape[:-1], n)
    if input_scale is not None:
        aq, a_s = fp8_quant.per_tensor_quant_fp8(x2, fp8, input_scale.float().reshape(1))
    else:
        aq, a_s = fp8_quant.per_token_quant_fp8(x2, fp8)
    if use_scaled_mm is None:
        use_scaled_mm = scaled_mm_supported(x.device)
    if use_scaled_mm:
        y = scaled_mm(aq, weight, a_s, weight_scale, x.dtype, bias)
    else:
        y = w8a8_matmul(aq, weight, a_s, weight_scale, x.dtype, bias)
    return y.reshape(*x.shape[:-1], n)

"""FP8 weights in a linear layer: the weight stays FP8 in memory with its fp32 scales beside it
(`weight_scale`, a dequantization multiplier in the layout of `layers.fp8_scheme.Fp8Scheme`, and
`input_scale` for static activations), and `LinearBase` runs it through the FP8 ops: the batch-1
GEMV family reads the FP8 bytes (x stays in the run dtype), `ops.fp8_linear` quantizes x and
multiplies FP8 by FP8 for more rows.

A layer becomes FP8 in one of two ways:
- from an FP8 checkpoint (`make_fp8` before loading): the weight parameter turns FP8 and the
  scale parameters appear, each with a loader that places this rank's part of a checkpoint
  scale where the layer's `placement` puts the matching rows or columns of the weight (block
  scales in units of blocks). Per-tensor scales of a fused layer's parts (q, k and v each have
  one) are kept per output row; a layer whose rows all got one value runs per tensor again.
  The parts' static input scales become their maximum (one input, one scale: vLLM's choice).
- at load (`quantize_online`, `--quantization fp8`): the loaded half-precision weight is
  quantized per output row.

After loading (`finish_fp8`): a gfx942 GPU (MI300) gets its e4m3fnuz copy of e4m3fn
checkpoints; where no FP8 GEMM runs (CPU, older GPUs: `runs_natively`) the weight is
dequantized to the run dtype, so the model stays correct at the half-precision speed.
"""

from __future__ import annotations

import torch
from torch import nn

from atom_kernels.fp8_formats import (
    dequantize_fp8,
    e4m3fn_to_e4m3fnuz,
    quantize_weight_block,
    quantize_weight_per_channel,
    quantize_weight_per_tensor,
    scale_to_format,
)
from atom_runtime.layers.fp8_scheme import Fp8Scheme
from atom_runtime.layers.weights import copy_weight
from atom_runtime.system.distributed import tp_size


def runs_natively(device: torch.device) -> bool:
    """Whether FP8 weights run as FP8 on `device`: an NVIDIA GPU from sm_89 (Ada, Hopper, later)
    or an AMD gfx94x / gfx95x (MI300, MI355). Elsewhere they are dequantized at load."""
    from atom_kernels.fp8_gemm import scaled_mm_supported

    return device.type == "cuda" and scaled_mm_supported(device)


def make_fp8(layer: nn.Module, scheme: Fp8Scheme, fp8_dtype: torch.dtype) -> None:
    """Turn `layer` (a LinearBase in the run dtype, not loaded yet) into an FP8 layer whose
    parameters take an FP8 checkpoint's tensors: weight, weight_scale, (input_scale)."""
    n, k = layer.weight.shape
    device = layer.weight.device
    layer.run_dtype = layer.weight.dtype
    weight = nn.Parameter(torch.empty(n, k, dtype=fp8_dtype, device=device), requires_grad=False)
    weight.weight_loader = layer.weight_loader
    layer.weight = weight
    if scheme.weight == "block":
        bn, bk = scheme.block_size
        shape = (-(-n // bn), -(-k // bk))
    else:
        shape = (n,)  # per channel; per tensor too while loading (one value a part's rows)
    scale = nn.Parameter(torch.ones(shape, dtype=torch.float32, device=device), requires_grad=False)
    scale.weight_loader = lambda p, t, shard=None: load_weight_scale(layer, p, t, shard)
    layer.weight_scale = scale
    if scheme.static_input:
        inp = nn.Parameter(torch.zeros(1, dtype=torch.float32, device=device), requires_grad=False)
        inp.weight_loader = _load_input_scale
        layer.input_scale = inp
    layer.fp8_scheme = scheme
    layer.weight_block_size = scheme.block_size


def block_fits(layer: nn.Module, block_size: tuple[int, int]) -> bool:
    """Whether every checkpoint part of `layer` on this rank starts on a scale block and spans
    whole blocks (the last part may end on a ragged block where it is not split across ranks):
    what loading block scales part by part, and the kernels' one scale row per block of rows,
    need."""
    bn, bk = block_size
    for shard in layer.shard_ids():
        dim, dst, src, size = layer.placement(shard)
        b = bn if dim == 0 else bk
        # A ragged last block is whole on its rank when nothing is split (one rank, or a
        # replicated layer: no checkpoint offset) and it ends the layer.
        ragged_ok = (src is None or tp_size() == 1) and dst + size == layer.weight.shape[dim]
        if dst % b or (src or 0) % b or (size % b and not ragged_ok):
            return False
    return True


def _block_rows(dst: int, src: int, size: int, b: int) -> tuple[int, int, int]:
    return dst // b, src // b, -(-size // b)


def load_weight_scale(layer: nn.Module, param: nn.Parameter, loaded, shard_id=None) -> None:
    """Place this rank's part of a checkpoint weight scale (`weight_scale` /
    `weight_scale_inv`) for checkpoint part `shard_id` of the layer."""
    scheme = layer.fp8_scheme
    dim, dst, src, size = layer.placement(shard_id)
    if scheme.weight == "tensor":
        value = _read(loaded).float().reshape(-1)
        if value.numel() != 1:
            raise ValueError(f"per-tensor weight scale of {value.numel()} values")
        rows = param.data.narrow(0, dst, size) if dim == 0 else param.data
        # (Not fill_(value.item()): the tensor-parallel read plan runs this on meta tensors.)
        rows.copy_(value.to(rows.device).expand_as(rows))
        return
    if scheme.weight == "channel":
        if dim == 1:  # a row-split layer keeps every output row
            copy_weight(param.data, _read(loaded).float().reshape(-1))
            return
        part = loaded if src is None else loaded.narrow(0, src, size)
        copy_weight(param.data.narrow(0, dst, size), _read(part).float().reshape(-1))
        return
    bn, bk = scheme.block_size
    b = bn if dim == 0 else bk
    d, s, count = _block_rows(dst, src or 0, size, b)
    part = loaded if src is None else loaded.narrow(dim, s, count)
    copy_weight(param.data.narrow(dim, d, count), _read(part).float())


def _load_input_scale(param: nn.Parameter, loaded, shard_id=None) -> None:
    """A part's static input scale: the layer keeps the largest of its parts' (x is one input;
    the largest scale clips none of them)."""
    value = _read(loaded).float().reshape(-1)
    if value.numel() != 1:
        raise ValueError(f"input_scale of {value.numel()} values: per-tensor scales only")
    param.data.copy_(torch.maximum(param.data, value.to(param.device)))


def _read(t) -> torch.Tensor:
    return t if isinstance(t, torch.Tensor) else t.read()


def quantize_online(layer: nn.Module, scheme: Fp8Scheme, fp8_dtype: torch.dtype) -> None:
    """Quantize a loaded half-precision layer in place: per output row for `--quantization fp8`
    (or as `scheme` says: a dummy model of an FP8 checkpoint's config gets its layout)."""
    w = layer.weight.data
    layer.run_dtype = w.dtype
    if scheme.weight == "block":
        q, scale = quantize_weight_block(w, scheme.block_size, fp8_dtype)
    elif scheme.weight == "channel":
        q, scale = quantize_weight_per_channel(w, fp8_dtype)
    else:
        q, scale = quantize_weight_per_tensor(w, fp8_dtype)
    layer.weight = nn.Parameter(q, requires_grad=False)
    layer.weight_scale = nn.Parameter(scale.contiguous(), requires_grad=False)
    if scheme.static_input:  # no calibration here: 1.0 (dummy weights only reach this)
        layer.input_scale = nn.Parameter(torch.ones(1, device=w.device), requires_grad=False)
    layer.fp8_scheme = scheme
    layer.weight_block_size = scheme.block_size


def finish_fp8(layer: nn.Module, fp8_dtype: torch.dtype, native: bool, dtype: torch.dtype) -> None:
    """After loading: per-row scales that are one value run per tensor; e4m3fn data moves to
    e4m3fnuz where the platform computes in it; without FP8 GEMMs (`native` False) the weight
    is dequantized to `dtype` and the layer runs as a plain one."""
    scale = layer.weight_scale.data
    if layer.fp8_scheme.weight != "block" and scale.numel() > 1 and bool((scale == scale[0]).all()):
        scale = scale[:1].clone()
    weight = layer.weight.data
    if weight.dtype != fp8_dtype:
        if fp8_dtype != torch.float8_e4m3fnuz or weight.dtype != torch.float8_e4m3fn:
            raise ValueError(f"FP8 weight in {weight.dtype}: this platform computes in {fp8_dtype}")
        weight, scale = e4m3fn_to_e4m3fnuz(weight, scale)
        if layer.input_scale is not None:
            moved = scale_to_format(layer.input_scale.data, torch.float8_e4m3fn, fp8_dtype)
            layer.input_scale = nn.Parameter(moved, requires_grad=False)
    if not native:
        dense = dequantize_fp8(weight, scale, layer.weight_block_size, dtype)
        make_dense(layer, dense)
        return
    layer.weight = nn.Parameter(weight, requires_grad=False)
    layer.weight_scale = nn.Parameter(scale.contiguous(), requires_grad=False)


def make_dense(layer: nn.Module, weight: torch.Tensor) -> None:
    """`layer` as a plain layer with this run-dtype weight (its FP8 parameters dropped)."""
    layer.weight = nn.Parameter(weight, requires_grad=False)
    layer.weight_scale = None
    layer.input_scale = None
    layer.fp8_scheme = None
    layer.weight_block_size = None


def dense_weight(layer: nn.Module) -> torch.Tensor:
    """The FP8 weight dequantized to the run dtype (for code that multiplies by parts of it)."""
    return dequantize_fp8(
        layer.weight, layer.weight_scale, layer.weight_block_size, layer.run_dtype
    )

"""FP8 (e4m3) formats and the weight layouts of FP8 checkpoints, in plain torch.

Two 8-bit e4m3 encodings exist in the wild. `float8_e4m3fn` (OCP; NVIDIA Hopper/Blackwell, AMD
gfx950 = MI355) has exponent bias 7, a negative zero and NaN at S.1111.111, largest 448.
`float8_e4m3fnuz` (AMD gfx942 = MI300) has bias 8, no negative zero (0x80 is its only NaN) and
largest 240. Checkpoints are written in e4m3fn; a gfx942 GPU computes only in e4m3fnuz, so the
loader converts (`e4m3fn_to_e4m3fnuz`): the same bit pattern means half the value in fnuz, so
the bits stay and the scale doubles.

Scale convention, everywhere in `atom_kernels`: a scale is the dequantization multiplier,
`real = fp8_value * scale`. That is what both checkpoint families store: block-FP8 checkpoints
(DeepSeek-V3, Qwen3-*-FP8) call it `weight_scale_inv` (the inverse of the quantization
multiplier), compressed-tensors calls it `weight_scale`. Layouts of a weight `[N, K]`'s scale:

- per tensor: `[]` or `[1]`;
- per channel (one per output row): `[N]` or `[N, 1]`;
- block (`weight_block_size = (bn, bk)`, 128 x 128 in every known checkpoint):
  `[ceil(N / bn), ceil(K / bk)]`, entry (i, j) scaling rows `i*bn..` and columns `j*bk..`.

Activations are quantized per tensor, per token (`[M, 1]`) or per token group of 128 columns
(`[M, ceil(K / 128)]`, the block layout's activation side); those live in `fp8_quant.py`
(Triton) and `reference.py` (torch).
"""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
# The block of every known block-scaled checkpoint; also the activation group size.
DEFAULT_BLOCK = (128, 128)
# Saturation bound of *dynamic* quantization (scale = amax / bound). e4m3fn: its largest value.
# e4m3fnuz: 224, not 240 (0x7E, not 0x7F), as ROCm's stacks do: at 240 the largest element's
# rounding lands on the format's sparse top binade and dynamic quantization lost accuracy there.
_DYNAMIC_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e4m3fnuz: 224.0}
# Smallest amax a dynamic scale is computed from, so an all-zero row or block gets a finite scale.
MIN_AMAX = 1e-12


def is_fp8(x: torch.dtype | torch.Tensor | None) -> bool:
    """Whether `x` (a dtype or a tensor) is one of the e4m3 FP8 formats."""
    dtype = x.dtype if isinstance(x, torch.Tensor) else x
    return dtype in FP8_DTYPES


def fp8_max(dtype: torch.dtype) -> float:
    """The format's largest finite value (448 e4m3fn, 240 e4m3fnuz): the clamp of a
    quantization whose scale is given (static activation scales, the KV cache)."""
    _require_fp8(dtype)
    return float(torch.finfo(dtype).max)


def dynamic_quant_max(dtype: torch.dtype) -> float:
    """The value the largest element maps to when the scale is computed from the data
    (`scale = amax / dynamic_quant_max`): 448 for e4m3fn, 224 for e4m3fnuz."""
    _require_fp8(dtype)
    return _DYNAMIC_MAX[dtype]


def fp8_dtype_for_arch(hip: bool, gcn_arch: str | None) -> torch.dtype:
    """The FP8 format a GPU computes in: e4m3fnuz on gfx94x (MI300 series), e4m3fn on every
    NVIDIA GPU and every other AMD architecture (gfx950 = MI355 and later use the OCP format).
    `gcn_arch` is `gcnArchName` as ROCm reports it, feature flags included
    ("gfx942:sramecc+:xnack-")."""
    if not hip:
        return torch.float8_e4m3fn
    if not gcn_arch:
        raise ValueError("a ROCm device without a gcnArchName: cannot tell its FP8 format")
    arch = gcn_arch.split(":", 1)[0].strip().lower()
    return torch.float8_e4m3fnuz if arch.startswith("gfx94") else torch.float8_e4m3fn


def fp8_dtype_for_platform(device: torch.device | int | None = None) -> torch.dtype:
    """The FP8 format for weights, activations and the KV cache on `device` (the current GPU
    by default): decided by the platform (`fp8_dtype_for_arch`). Without a GPU, e4m3fn (the
    checkpoints' format; the CPU path dequantizes anyway)."""
    if isinstance(device, torch.device) and device.type != "cuda":
        return torch.float8_e4m3fn
    if not torch.cuda.is_available():
        return torch.float8_e4m3fn
    hip = torch.version.hip is not None
    arch = getattr(torch.cuda.get_device_properties(device), "gcnArchName", None) if hip else None
    return fp8_dtype_for_arch(hip, arch)


def e4m3fn_to_e4m3fnuz(
    weight: torch.Tensor, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """An e4m3fn tensor and its dequantization scale(s) as e4m3fnuz with the scale doubled: the
    same real values. Every finite bit pattern means exactly half as much in fnuz (bias 8 against
    7, subnormals included), so the bits are kept, except 0x80 (e4m3fn's -0, fnuz's NaN), which
    becomes 0x00, and e4m3fn's NaNs (0x7F, 0xFF: ±240 in fnuz), which become fnuz's NaN. Returns
    new tensors; the inputs are left alone. `scale` may be any scale layout (or an activation or
    KV scale: it doubles the same way)."""
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"expected a float8_e4m3fn tensor, got {weight.dtype}")
    bits = weight.view(torch.uint8).clone()
    nan = (bits & 0x7F) == 0x7F
    bits[bits == 0x80] = 0x00
    bits[nan] = 0x80
    return bits.view(torch.float8_e4m3fnuz), scale.float() * 2.0


def scale_to_format(scale: torch.Tensor, src: torch.dtype, dst: torch.dtype) -> torch.Tensor:
    """A static scale calibrated for FP8 format `src` (an activation's `input_scale`, a KV
    cache's `k_scale`) for use with `dst`: doubled from e4m3fn to e4m3fnuz, halved back, the
    same otherwise. Quantizing x with the result in `dst` gives the bits x got in `src`."""
    _require_fp8(src)
    _require_fp8(dst)
    if src == dst:
        return scale
    return scale.float() * (2.0 if dst == torch.float8_e4m3fnuz else 0.5)


def scale_layout(
    weight_shape: tuple[int, ...] | torch.Size,
    scale: torch.Tensor,
    block_size: tuple[int, int] | list[int] | None,
) -> str:
    """The layout of `scale` for an `[N, K]` weight: "tensor", "channel" or "block" (module
    docstring), checked; raises ValueError naming the mismatch otherwise."""
    n, k = weight_shape
    if block_size is not None:
        bn, bk = block_size
        want = (-(-n // bn), -(-k // bk))
        if scale.dim() != 2 or tuple(scale.shape) != want:
            raise ValueError(
                f"block scale for a [{n}, {k}] weight in {bn}x{bk} blocks must be {list(want)}, "
                f"got {list(scale.shape)}"
            )
        return "block"
    if scale.numel() == 1 and scale.dim() <= 1:
        return "tensor"
    if tuple(scale.shape) in ((n,), (n, 1)):
        return "channel"
    raise ValueError(
        f"weight scale {list(scale.shape)} fits no layout of a [{n}, {k}] weight: [] or [1] per "
        f"tensor, [{n}] or [{n}, 1] per channel, or 2-D blocks with weight_block_size"
    )


def dequantize_fp8(
    q: torch.Tensor,
    scale: torch.Tensor,
    block_size: tuple[int, int] | list[int] | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """`q * scale` in fp32, rounded to `dtype`, for a 2-D `[N, K]` FP8 tensor with a scale in any
    layout (`scale_layout`): per tensor, per row (`[N]`, `[N, 1]`, or an activation's per-token
    `[M, 1]`), or in blocks of `block_size` (a weight's `[ceil(N/bn), ceil(K/bk)]`; an
    activation's per-token-group `[M, ceil(K/g)]` is blocks of (1, g))."""
    if not is_fp8(q):
        raise ValueError(f"expected an FP8 tensor, got {q.dtype}")
    layout = scale_layout(q.shape, scale, block_size)
    s = scale.float()
    if layout == "block":
        bn, bk = block_size
        n, k = q.shape
        s = s.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    elif layout == "channel":
        s = s.reshape(-1, 1)
    return (q.float() * s).to(dtype)


def quantize_weight_per_tensor(
    weight: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale `[1]`) with scale = amax / `dynamic_quant_max(dtype)` over the whole weight."""
    amax = weight.detach().abs().amax().float().reshape(1)
    scale = amax.clamp(min=MIN_AMAX) / dynamic_quant_max(dtype)
    return round_to_fp8(weight.float() / scale, dtype), scale


def quantize_weight_per_channel(
    weight: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q `[N, K]`, scale fp32 `[N]`): each output row scaled by its own amax, what
    `--quantization fp8` makes of a half-precision weight (compressed-tensors' "channel"
    strategy, which stores the scale as `[N, 1]`: the same values)."""
    if weight.dim() != 2:
        raise ValueError(f"expected a [N, K] weight, got {list(weight.shape)}")
    amax = weight.detach().abs().amax(dim=1).float()
    scale = amax.clamp(min=MIN_AMAX) / dynamic_quant_max(dtype)
    return round_to_fp8(weight.float() / scale[:, None], dtype), scale


def quantize_weight_block(
    weight: torch.Tensor,
    block_size: tuple[int, int] | list[int] = DEFAULT_BLOCK,
    dtype: torch.dtype = torch.float8_e4m3fn,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q `[N, K]`, scale fp32 `[ceil(N/bn), ceil(K/bk)]`): each bn x bk block scaled by its own
    amax (the layout of DeepSeek-V3 / Qwen3-FP8 checkpoints; ragged edge blocks allowed)."""
    if weight.dim() != 2:
        raise ValueError(f"expected a [N, K] weight, got {list(weight.shape)}")
    bn, bk = block_size
    n, k = weight.shape
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.zeros(rows * bn, cols * bk, dtype=torch.float32, device=weight.device)
    padded[:n, :k] = weight.float()
    blocks = padded.view(rows, bn, cols, bk)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = amax.clamp(min=MIN_AMAX) / dynamic_quant_max(dtype)
    q = round_to_fp8(blocks / scale[:, None, :, None], dtype).view(rows * bn, cols * bk)
    return q[:n, :k].contiguous(), scale


def round_to_fp8(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x clamped to the format's range, then rounded to nearest even (torch's cast): how every
    FP8 quantization here rounds, kernels included."""
    m = fp8_max(dtype)
    return x.clamp(-m, m).to(dtype)


def _require_fp8(dtype: torch.dtype) -> None:
    if dtype not in FP8_DTYPES:
        raise ValueError(f"{dtype} is not an FP8 e4m3 format ({', '.join(map(str, FP8_DTYPES))})")

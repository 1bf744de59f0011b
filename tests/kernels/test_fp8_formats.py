"""FP8 formats and checkpoint weight layouts (`atom_kernels.fp8_formats`), plain torch on CPU:
the platform's format, the e4m3fn -> e4m3fnuz load-time conversion bit for bit over all 256
patterns, the weight quantizers' layouts and error bounds, and the scale-layout checks."""

from __future__ import annotations

import pytest
import torch

from atom_kernels import fp8_formats as f8

FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz
ALL_BITS = torch.arange(256, dtype=torch.int32).to(torch.uint8)


@pytest.mark.parametrize(
    ("hip", "arch", "want"),
    [
        (False, None, FN),  # every NVIDIA GPU
        (True, "gfx942:sramecc+:xnack-", FNUZ),  # MI300X / MI325X
        (True, "gfx940", FNUZ),
        (True, "gfx941", FNUZ),
        (True, "gfx950:sramecc+:xnack-", FN),  # MI355X: OCP e4m3fn
        (True, "gfx1201", FN),
        (True, "GFX942", FNUZ),
    ],
)
def test_platform_format_follows_the_architecture(hip, arch, want):
    assert f8.fp8_dtype_for_arch(hip, arch) == want


def test_a_rocm_device_without_an_architecture_name_is_refused():
    with pytest.raises(ValueError, match="gcnArchName"):
        f8.fp8_dtype_for_arch(True, None)


def test_platform_format_without_a_gpu_is_e4m3fn():
    assert f8.fp8_dtype_for_platform(torch.device("cpu")) == FN
    if not torch.cuda.is_available():
        assert f8.fp8_dtype_for_platform() == FN


def test_fnuz_conversion_keeps_every_value_with_the_scale_doubled():
    """All 256 e4m3fn patterns: each finite one becomes the fnuz pattern of half its value (the
    same bits, -0 aside), so times the doubled scale it is the same number; -0 (0x80, fnuz's
    NaN) becomes +0; the two NaNs become fnuz's NaN."""
    fn = ALL_BITS.view(FN)
    scale = torch.tensor([0.37], dtype=torch.float32)
    before = fn.clone()
    fnuz, doubled = f8.e4m3fn_to_e4m3fnuz(fn, scale)
    assert fnuz.dtype == FNUZ and torch.equal(fn.view(torch.uint8), before.view(torch.uint8))
    assert torch.equal(doubled, scale * 2)
    bits = fnuz.view(torch.uint8)
    finite = ~fn.float().isnan()
    assert torch.equal(fnuz.float()[finite] * 2, fn.float()[finite])  # exact, value for value
    assert torch.equal((fnuz.float() * doubled)[finite], (fn.float() * scale)[finite])
    assert bits[0x80] == 0x00 and not fnuz.float()[0x80].isnan()
    keep = finite.clone()
    keep[0x80] = False
    assert torch.equal(bits[keep], ALL_BITS[keep])  # everything else keeps its bits
    assert bits[0x7F] == 0x80 and bits[0xFF] == 0x80
    assert fnuz.float()[0x7F].isnan() and fnuz.float()[0xFF].isnan()


def test_fnuz_conversion_of_a_quantized_weight_dequantizes_identically():
    w = torch.randn(37, 300, generator=torch.Generator().manual_seed(0))
    for quantize, block in (
        (f8.quantize_weight_per_tensor, None),
        (f8.quantize_weight_per_channel, None),
        (lambda t: f8.quantize_weight_block(t, (128, 128)), (128, 128)),
    ):
        q, s = quantize(w)
        q[0, :3] = torch.tensor([-0.0, 0.0, -0.0]).to(FN)
        qz, sz = f8.e4m3fn_to_e4m3fnuz(q, s)
        assert torch.equal(f8.dequantize_fp8(qz, sz, block), f8.dequantize_fp8(q, s, block))


def test_fnuz_conversion_refuses_other_dtypes():
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        f8.e4m3fn_to_e4m3fnuz(torch.zeros(4, dtype=FNUZ), torch.ones(1))


def test_static_scales_move_between_formats():
    s = torch.tensor([0.25])
    assert torch.equal(f8.scale_to_format(s, FN, FNUZ), s * 2)
    assert torch.equal(f8.scale_to_format(s * 2, FNUZ, FN), s)
    assert f8.scale_to_format(s, FN, FN) is s
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1)) * 20
    fn_bits = (x / s).clamp(-448, 448).to(FN)
    fnuz_bits = (x / f8.scale_to_format(s, FN, FNUZ)).clamp(-240, 240).to(FNUZ)
    nonzero = fn_bits.float() != 0
    assert torch.equal(fn_bits.view(torch.uint8)[nonzero], fnuz_bits.view(torch.uint8)[nonzero])


def test_format_bounds():
    assert f8.fp8_max(FN) == 448.0 and f8.fp8_max(FNUZ) == 240.0
    assert f8.dynamic_quant_max(FN) == 448.0 and f8.dynamic_quant_max(FNUZ) == 224.0
    assert f8.is_fp8(FN) and f8.is_fp8(torch.zeros(1, dtype=FNUZ)) and not f8.is_fp8(torch.half)
    with pytest.raises(ValueError, match="not an FP8"):
        f8.fp8_max(torch.bfloat16)


def _within_rounding(deq: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> bool:
    """|deq - w| within half an e4m3 step: 2^-4 relative for normals, half the subnormal step
    (2^-10 of the scale) near zero."""
    return bool(((deq - w).abs() <= w.abs() * 2**-4 + scale * 2**-10 + 1e-12).all())


@pytest.mark.parametrize("dtype", [FN, FNUZ])
def test_per_channel_weight_quantization(dtype):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(37, 300, generator=g) * torch.rand(37, 1, generator=g) * 5
    w[5] = 0.0  # an all-zero row gets a finite scale and zeros
    q, s = f8.quantize_weight_per_channel(w, dtype)
    assert q.dtype == dtype and q.shape == w.shape and s.shape == (37,) and s.dtype == torch.float32
    deq = f8.dequantize_fp8(q, s)
    assert _within_rounding(deq, w, s[:, None])
    assert torch.equal(deq[5], torch.zeros(300)) and s[5] > 0
    # each nonzero row's largest element lands on the format's dynamic bound
    top = q.float().abs().amax(dim=1)
    live = w.abs().amax(dim=1) > 0
    assert torch.equal(top[live], torch.full_like(top[live], f8.dynamic_quant_max(dtype)))
    assert torch.equal(f8.dequantize_fp8(q, s[:, None]), deq)  # [N, 1] is the same layout


@pytest.mark.parametrize(("n", "k"), [(300, 700), (128, 256), (5, 130)])
def test_block_weight_quantization_on_ragged_blocks(n, k):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(n, k, generator=g)
    w[:, :128] *= 40  # blocks of very different ranges
    q, s = f8.quantize_weight_block(w, (128, 128))
    assert s.shape == (-(-n // 128), -(-k // 128)) and q.shape == (n, k)
    deq = f8.dequantize_fp8(q, s, (128, 128))
    expanded = s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    assert _within_rounding(deq, w, expanded)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            block = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            assert s[i, j] == block.abs().amax() / 448.0


def test_per_tensor_weight_quantization():
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(4))
    q, s = f8.quantize_weight_per_tensor(w)
    assert s.shape == (1,) and s.item() == (w.abs().amax() / 448.0).item()
    assert _within_rounding(f8.dequantize_fp8(q, s), w, s)


def test_scale_layouts_are_recognised_and_mismatches_named():
    shape = (300, 700)
    assert f8.scale_layout(shape, torch.ones(()), None) == "tensor"
    assert f8.scale_layout(shape, torch.ones(1), None) == "tensor"
    assert f8.scale_layout(shape, torch.ones(300), None) == "channel"
    assert f8.scale_layout(shape, torch.ones(300, 1), None) == "channel"
    assert f8.scale_layout(shape, torch.ones(3, 6), (128, 128)) == "block"
    with pytest.raises(ValueError, match=r"must be \[3, 6\]"):
        f8.scale_layout(shape, torch.ones(3, 5), (128, 128))
    with pytest.raises(ValueError, match="fits no layout"):
        f8.scale_layout(shape, torch.ones(3, 6), None)
    with pytest.raises(ValueError, match="fits no layout"):
        f8.scale_layout(shape, torch.ones(299), None)

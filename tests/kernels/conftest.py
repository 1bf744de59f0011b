"""Kernel tests run the Triton kernels compiled on a GPU, or under the Triton interpreter
on CPU tensors when there is none.

TRITON_INTERPRET is read when a `@triton.jit` function is defined, so it is set here,
before any test imports a kernel module; `kernels` reloads the modules if something
imported them earlier in compiled mode.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

KERNEL_MODULES = (
    "atom_kernels.fp8_quant",  # first: the modules below import its in-kernel helpers
    "atom_kernels.fp8_gemm",
    "atom_kernels.kv_cache",
    "atom_kernels.decode_attention",
    "atom_kernels.prefill_attention",
    "atom_kernels.norm",
    "atom_kernels.rotary",
    "atom_kernels.fused",
    "atom_kernels.conv1d",
    "atom_kernels.gdn",
    "atom_kernels.gdn_token",
    "atom_kernels.gdn_decode_wide",
    "atom_kernels.gdn_decode",
    "atom_kernels.moe",
    "atom_kernels.state_copy",
    "atom_kernels.gemv",
    "atom_kernels.mla_attention",
    "atom_kernels.gemv_rows",
)


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda") if HAS_GPU else torch.device("cpu")


@pytest.fixture(scope="session")
def kernels():
    """The kernel modules, guaranteed to interpret on CPU and to compile on a GPU."""
    from triton.runtime.interpreter import InterpretedFunction

    from atom_kernels import ops

    modules = {name.rsplit(".", 1)[1]: importlib.import_module(name) for name in KERNEL_MODULES}
    probe = modules["decode_attention"]._decode_split_kernel
    if isinstance(probe, InterpretedFunction) == HAS_GPU:
        modules = {short: importlib.reload(m) for short, m in modules.items()}
        ops.refresh_backend()
    probe = modules["decode_attention"]._decode_split_kernel
    if isinstance(probe, InterpretedFunction) == HAS_GPU:
        raise RuntimeError("could not put the Triton kernels in the right (interpreted) mode")
    return modules


# Triton element type name -> torch dtype, for the FP8 formats the kernels use.
_TORCH_FP8 = {
    "fp8e4nv": torch.float8_e4m3fn,
    "fp8e4b8": torch.float8_e4m3fnuz,
    "fp8e5": torch.float8_e5m2,
}
_NUMPY_FLOAT = {"fp32": torch.float32, "fp16": torch.float16, "fp64": torch.float64}


@pytest.fixture
def exact_fp8_casts(monkeypatch):
    """Casts to and from FP8 under the interpreter done by torch's conversions (round to nearest
    even; NaN kept), as the GPU's do. Triton 3.9's interpreter drops the carry when rounding to
    FP8 carries into the exponent (31.1 -> 16, not 32: about 2% of random values off by 2x) and
    reads e4m3fn's NaN as 480, so FP8 writers could not be checked bit for bit on CPU without
    this. Only casts with an FP8 side and an fp16/fp32/fp64 other side are replaced; a GPU run
    changes nothing. Raises if the interpreter's cast hook is gone (a Triton upgrade), rather
    than testing through the broken conversion."""
    if HAS_GPU:
        yield
        return
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    real = builder.create_fp_to_fp

    def fp_to_fp(self, src, dst_type, rounding_mode):
        src_name, dst_name = src.dtype.scalar.name, dst_type.scalar.name
        if dst_name in _TORCH_FP8 and src_name in _NUMPY_FLOAT:
            values = torch.from_numpy(np.array(src.data, copy=True))
            data = values.to(_TORCH_FP8[dst_name]).view(torch.uint8).numpy()
            return interpreter.TensorHandle(data, dst_type.scalar)
        if src_name in _TORCH_FP8 and dst_name in _NUMPY_FLOAT:
            bits = torch.from_numpy(np.array(src.data, copy=True)).view(_TORCH_FP8[src_name])
            data = bits.to(_NUMPY_FLOAT[dst_name]).numpy()
            return interpreter.TensorHandle(data, dst_type.scalar)
        return real(self, src, dst_type, rounding_mode)

    monkeypatch.setattr(builder, "create_fp_to_fp", fp_to_fp)
    yield

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
    "atom_kernels.kv_cache",
    "atom_kernels.decode_attention",
    "atom_kernels.prefill_attention",
    "atom_kernels.norm",
    "atom_kernels.rotary",
    "atom_kernels.fused",
    "atom_kernels.conv1d",
    "atom_kernels.gdn",
    "atom_kernels.gdn_decode",
    "atom_kernels.moe",
    "atom_kernels.state_copy",
    "atom_kernels.mla_attention",
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

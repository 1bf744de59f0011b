"""Programmatic dependent launch (PDL) for the decode step's kernels, Hopper and later.

A decode step at batch 1 is some 300 kernels of 1–20 us each, back to back: every kernel
boundary costs the previous grid's drain, the next grid's launch and its prologue, about a
microsecond each time. With PDL a kernel is launched with programmatic stream serialization,
so its programs may start while the kernel before it is still running; each program first waits
(`griddepcontrol.wait`: every write of the kernel before is done and visible) and then lets the
kernel after it launch in turn (`griddepcontrol.launch_dependents`). The wait is the first thing a
kernel does, before any load or store, so a kernel never reads an input early or overwrites
something the kernel before still reads; what overlaps is the launch, the scheduling of the
programs and their arrival at the wait. Kernels launched without the attribute (cuBLAS, torch's
own) keep the plain stream order, and a kernel after them simply finds the wait satisfied.
Captured into a CUDA graph, each launch becomes a programmatic edge.

On by default where it runs (an NVIDIA GPU of compute capability 9 or more, a Triton with
`launch_pdl`); `ATOM_PDL=0` turns it off. W2 on an H200, off against on in one call: Qwen3-0.6B
1.232 -> 1.129 ms/token, Llama-3.1-8B 4.445 -> 4.339, the Qwen3.5-4B-shaped hybrid 3.276 ->
3.078; W1 unchanged (30,216 and 30,179 tok/s): at batch 256 the step is bandwidth-bound. The
GEMV loads its first 1,024 weight columns before the wait (docs/kernels.md).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from atom_kernels import envs


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """First statement of a kernel that may be launched with PDL: wait for the kernel before,
    then let the one after launch. Nothing when PDL is off (also under the interpreter)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def _triton_supports_pdl() -> bool:
    try:
        import triton.language.extra.cuda as cuda_extra
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    fields = getattr(CUDAOptions, "__dataclass_fields__", {})
    return "launch_pdl" in fields and hasattr(cuda_extra, "gdc_wait")


@functools.lru_cache(maxsize=16)
def _enabled(device_index: int) -> bool:
    if not envs.PDL.enabled() or torch.version.hip is not None:
        return False
    if os.environ.get("TRITON_INTERPRET") == "1" or not _triton_supports_pdl():
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` are launched with PDL."""
    if device.type != "cuda":
        return False
    return _enabled(device.index if device.index is not None else torch.cuda.current_device())


def options(device: torch.device) -> dict:
    """Launch keywords for a kernel that starts with `wait_for_inputs(PDL)`."""
    return {"PDL": True, "launch_pdl": True} if enabled(device) else {"PDL": False}

"""Arrival counters for split kernels that merge their own partial results (the GEMV's split-K).

A split-K kernel normally needs a second launch to combine its splits' partial results. With
tickets the splits of one output tile each take a number from a counter after writing their
partial result (an acquire-release atomic add, behind a barrier so the whole program's
stores are ordered before it); the program that draws the last number sums every split's
partial result and writes the output, then sets the counter back to zero for the next launch.
That saves a launch (and the gap before it) per split kernel, which at batch 1 is most of
what the second kernel costs: on an H200 the Llama-3.1-8B o_proj GEMV took 10.6 us with
tickets against 10.8 + 1.65 us with its reduce kernel.

The merge's loads must be issued together to pay: decode attention merging its splits this
way (a loop over the live splits, one L2 round trip each) took 6.5 us a layer at batch 1
against 3.8 + 1.8 us with its merge kernel, so it keeps the kernel.

The counters live in one int32 buffer per device, zeroed once and left at zero by every
launch that uses them. Launches that use it run one after another on a stream; two streams
running ticketed kernels at once on one device would share counters and must not.
"""

from __future__ import annotations

import torch

_INITIAL_SIZE = 1 << 16
_counters: dict[torch.device, torch.Tensor] = {}
# Buffers outgrown stay allocated: CUDA graphs captured earlier still point into them.
_outgrown: list[torch.Tensor] = []


def ticket_counters(device: torch.device, count: int) -> torch.Tensor | None:
    """A zeroed int32 buffer of at least `count` counters on `device`, or None when it would
    have to grow while a CUDA graph is being captured (callers then launch a separate merge
    kernel instead)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    buf = _counters.get(device)
    if buf is None or buf.numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        size = max(_INITIAL_SIZE, 1 << (count - 1).bit_length())
        if buf is not None:
            _outgrown.append(buf)
        buf = torch.zeros(size, dtype=torch.int32, device=device)
        _counters[device] = buf
    return buf

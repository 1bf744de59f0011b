"""Start-up choice of the fused Gated DeltaNet decode kernel for batches that fill the GPU.

At W1's batch of 256 the GDN layers' state stream is most of a decode step's bytes (26 GB of
51 a step for Qwen3.5-4B with an fp32 state), so how close its kernel runs to the copy ceiling
decides the step. Which launch of `atom_kernels.gdn_decode_wide` streams best (tile width,
warps, the prefetch) depends on the GPU, the Triton version and the state dtype, and
gdn_decode.py's kernel (the path before it) stays a candidate. So on a GPU the model runner
times them once, on a decode step of the largest batch through every GDN layer (each layer's
own slot tensors, so the states stream from memory as in a step), each replayed in a CUDA
graph, and every later launch on that layer shape takes the winner
(`gdn_decode_wide.set_launch_shape`). ATOM_GDN_DECODE=split|wide skips the timing.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from atom_kernels import gdn_decode, gdn_decode_wide
from atom_runtime.worker.kernel_choice import graph_times, that_build

log = logging.getLogger(__name__)


def choose_gdn_decode_launch(
    layers: list[nn.Module], device: torch.device, batch: int
) -> dict | None:
    """Time the wide kernel's launch candidates and gdn_decode.py's kernel on `batch` rows (one
    token each, slots 0..batch-1, resuming) through every GDN layer in `layers` (their state
    tensors bound), set the fastest for their layer shape and return it; None where there is
    nothing to choose (no GPU, a forced path, a batch gdn_decode.py's split launch serves, no
    candidate that builds). The slots it ran on are zeroed again."""
    if device.type != "cuda" or not layers or gdn_decode_wide.DECODE_PATH != "auto":
        return None
    first = layers[0]
    hv, dk, dv = first.ssm_state.shape[1:]
    hk = first.num_k_heads
    batch = min(batch, first.ssm_state.shape[0])
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    layer = gdn_decode_wide.layer_key(hk, hv, dk, dv, first.ssm_state.dtype)
    if not gdn_decode_wide.takes_wide_path(batch, hk, sms):
        return None
    where = first.ssm_state.device
    gen = torch.Generator(device=where).manual_seed(0)
    width = first.conv_dim + hv * dv + 2 * hv
    dtype = first.conv_weight.dtype
    proj = (torch.randn(batch, width, generator=gen, device=where) * 0.5).to(dtype)
    slots = torch.arange(batch, dtype=torch.int32, device=where)
    resume = torch.ones(batch, dtype=torch.bool, device=where)

    def step(config: dict):
        """One decode token through every layer on `config`'s kernel."""
        knobs = {k: v for k, v in config.items() if k != "kernel"}

        def run():
            for m in layers:
                args = _args(m, proj, slots, resume)
                if config["kernel"] == "split":
                    gdn_decode.gated_delta_net_decode_(*args, v_split=1)
                else:
                    gdn_decode_wide.gated_delta_net_decode_wide_(*args, **knobs)

        return run

    candidates = [*gdn_decode_wide.launch_candidates(dk, dv), {"kernel": "split"}]
    try:
        usable = that_build(candidates, lambda c: step(c)(), f"GDN decode at batch {batch}")
        if not usable:
            return None
        times = graph_times(*(step(c) for c in usable))
    finally:
        for m in layers:
            m.conv_state[:batch].zero_()
            m.ssm_state[:batch].zero_()
    best = usable[times.index(min(times))]
    gdn_decode_wide.set_launch_shape(layer, best)
    log.info(
        "GDN decode at batch %d (%d layers, %s state): %s -> %s",
        batch,
        len(layers),
        str(first.ssm_state.dtype).removeprefix("torch."),
        ", ".join(
            f"{_name(c)} {t * 1e3 / len(layers):.1f} us" for c, t in zip(usable, times, strict=True)
        ),
        _name(best),
    )
    return best


def _args(m: nn.Module, proj: torch.Tensor, slots: torch.Tensor, resume: torch.Tensor) -> tuple:
    """`gated_delta_net_decode_`'s arguments for layer m on these rows."""
    return (
        proj, m.conv_weight, m.conv_state, m.ssm_state, m.A_log, m.dt_bias, m.norm.weight,
        m.norm.eps, slots, resume, m.k_dim**-0.5,
    )  # fmt: skip


def _name(config: dict) -> str:
    if config["kernel"] == "split":
        return "gdn_decode.py unsplit"
    prefetch = "" if config["prefetch"] else ", no prefetch"
    return f"wide {config['block_v']} columns/{config['num_warps']} warps{prefetch}"

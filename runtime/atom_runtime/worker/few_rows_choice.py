"""The few-row kernel choice for speculative verify steps: at batch 1 a verify step multiplies
k + 1 rows (the last token and its drafts) by every weight, and to pay off it must cost close to
a one-row decode step, i.e. read each weight once. At start-up on a GPU, with speculation on,
each group of linear layers of one shape (`kernel_choice.small_m_groups`) is timed at k + 1
rows through cuBLAS and through the few-row Triton product (`ops.linear_few_rows`, its launch
shape tuned first), each replayed in a CUDA graph over every layer of the group; the layers
take the faster (`LinearBase.gemv_rows`). ATOM_SMALL_M_KERNELS=cublas keeps cuBLAS, =gemv
takes the Triton product without timing."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from atom_kernels import ops
from atom_runtime.layers.linear import FEW_ROWS, LinearBase
from atom_runtime.worker.kernel_choice import graph_times, small_m_groups, small_m_mode, that_build

log = logging.getLogger(__name__)


def choose_few_rows_kernels(model: nn.Module, device: torch.device, rows: int) -> dict[str, str]:
    """Set every half-precision linear layer's few-row path for `rows`-row inputs; returns
    {group: "cublas" | "gemv-rows"} (empty off the GPU, or with rows outside 2..16; FP8
    groups keep their W8A8 path and are left out)."""
    mode = small_m_mode()
    if device.type != "cuda" or mode == "cublas" or not 2 <= rows <= FEW_ROWS:
        return {}
    choice = {}
    for key, layers in small_m_groups(model).items():
        if layers[0].weight_scale is not None:
            continue  # FP8 weights: the few-row product takes no scales; cuBLAS/W8A8 stays
        faster = True if mode == "gemv" else _rows_win(key, layers, rows, device)
        _use(layers, faster)
        choice[key] = "gemv-rows" if faster else "cublas"
    return choice


def _rows_win(key: str, layers: list[LinearBase], rows: int, device: torch.device) -> bool:
    """Whether the few-row product beats cuBLAS on this group at `rows` rows (timed)."""
    first = layers[0]
    x = torch.randn(rows, first.weight.shape[1], dtype=first.weight.dtype, device=device)
    _tune_launch(layers, x)
    act = first.act_after

    def cublas(layer: LinearBase):
        y = F.linear(x, layer.weight, layer._bias())
        return ops.silu_and_mul(y) if act else y

    def rows_path(layer: LinearBase):
        return ops.linear_few_rows(x, layer.weight, layer._bias(), act=act)

    if not that_build([rows_path], lambda fn: fn(first), f"{rows}-row {key}"):
        return False
    t_cublas, t_rows = graph_times(
        lambda: [cublas(m) for m in layers], lambda: [rows_path(m) for m in layers]
    )
    log.info(
        "%d-row %s projections (%d layers): cublas %.1f us, gemv-rows %.1f us -> %s",
        rows, key, len(layers), t_cublas * 1e3 / len(layers), t_rows * 1e3 / len(layers),
        "gemv-rows" if t_rows < t_cublas else "cublas",
    )  # fmt: skip
    return t_rows < t_cublas


def _use(layers: list[LinearBase], on: bool) -> None:
    for layer in layers:
        layer.gemv_rows = on


def _tune_launch(layers: list[LinearBase], x: torch.Tensor) -> None:
    """Time the few-row product's launch shapes on the group's weight shape; pin the fastest."""
    from atom_kernels import gemv_rows

    like = layers[0].weight
    n_out = like.shape[0] // 2 if layers[0].act_after else like.shape[0]
    k = like.shape[1]
    mp = torch.cuda.get_device_properties(like.device).multi_processor_count
    act = layers[0].act_after
    usable = that_build(
        gemv_rows.launch_candidates(n_out, k, mp),
        lambda cfg: gemv_rows.linear_few_rows(x, like, act=act, config=cfg),
        f"{x.shape[0]}-row {n_out}x{k} launch",
    )
    if not usable:
        return
    times = graph_times(
        *(
            lambda cfg=cfg: [
                gemv_rows.linear_few_rows(x, m.weight, act=act, config=cfg) for m in layers
            ]
            for cfg in usable
        )
    )
    gemv_rows.set_launch_shape(n_out, k, usable[times.index(min(times))])

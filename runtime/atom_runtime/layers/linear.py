"""Linear layers that know how they are split across tensor-parallel ranks.

Each parameter carries a `weight_loader(param, loaded, shard_id=None)` that copies this rank's part
of a checkpoint tensor into place, so a rank never holds the full model. `loaded` is a tensor or a
lazy checkpoint tensor (`models.loader.CheckpointTensor`): the loader narrows it to this rank's
rows or columns before anything is read, so a rank reads only its shard from disk.
"""

from __future__ import annotations

import logging
import os
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn

from atom_kernels import ops
from atom_runtime.distributed import all_reduce, tp_rank, tp_size

log = logging.getLogger(__name__)
SMALL_M_ENV = "ATOM_SMALL_M_KERNELS"  # "cublas": skip the start-up timing, never use the GEMV


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size ({d})")
    return n // d


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        # One-row inputs (batch-1 decode) go to the Triton GEMV when it beat cuBLAS for this
        # weight shape at start-up (`choose_small_m_kernels`).
        self.gemv = False
        # The activation the model fuses into this layer's input (RowParallelLinear's `act`),
        # and whether the model calls it through `forward_normed`.
        self.fused_act: str | None = None
        self.norm_before = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv and x.shape[0] == 1:
            return ops.linear_small_m(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def forward_normed(self, x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module):
        """`norm` (an RMSNorm, adding `residual` first when given), then this projection.
        Returns (output, residual after the add; x itself without a residual). A one-row x
        runs both in one GEMV launch when the GEMV won for this shape."""
        if self.gemv and x.shape[0] == 1:
            return ops.rms_norm_linear_small_m(
                x, residual, norm.weight, norm.eps, self.weight, self.bias
            )
        if residual is None:
            return self(norm(x)), x
        normed, residual = norm(x, residual)
        return self(normed), residual

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        copy_weight(param.data, loaded)


class ReplicatedLinear(LinearBase):
    pass


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication in forward."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        self.out_per_rank = _divide(out_features, tp_size(), "output features")
        super().__init__(in_features, self.out_per_rank, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        n = param.data.shape[0]
        copy_weight(param.data, loaded.narrow(0, tp_rank() * n, n))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections stored as one (gate_up): shard i is output_sizes[i]."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        size = self.output_sizes[shard_id] // tp_size()
        offset = sum(self.output_sizes[:shard_id]) // tp_size()
        copy_weight(param.data.narrow(0, offset, size), loaded.narrow(0, tp_rank() * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections as one matrix. KV heads are split across ranks, or replicated when
    there are fewer KV heads than ranks."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool
    ) -> None:
        tp = tp_size()
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp, "attention heads")
        if num_kv_heads >= tp:
            self.num_kv_heads = _divide(num_kv_heads, tp, "KV heads")
            self.kv_replicas = 1
        else:
            self.num_kv_heads = 1
            self.kv_replicas = _divide(tp, num_kv_heads, "ranks per KV head")
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        super().__init__(hidden_size, out * tp, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        if shard_id == "q":
            dst, src_index = param.data.narrow(0, 0, q_size), tp_rank()
            size = q_size
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            dst, size = param.data.narrow(0, offset, kv_size), kv_size
            src_index = tp_rank() // self.kv_replicas
        copy_weight(dst, loaded.narrow(0, src_index * size, size))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; one all-reduce of the output."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        self.in_per_rank = _divide(in_features, tp_size(), "input features")
        super().__init__(self.in_per_rank, out_features, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param.data.dim() == 1:  # bias: added once, after the reduce
            copy_weight(param.data, loaded)
            return
        n = param.data.shape[1]
        copy_weight(param.data, loaded.narrow(1, tp_rank() * n, n))

    def forward(self, x: torch.Tensor, act: str | None = None) -> torch.Tensor:
        """`act="silu_mul"`: x is [gate | up] and the input is silu(gate) * up (SwiGLU), fused
        into the GEMV for a one-row x."""
        bias = self.bias if tp_rank() == 0 else None
        if self.gemv and x.shape[0] == 1:
            y = ops.linear_small_m(x, self.weight, bias, act=act)
        else:
            y = F.linear(x if act is None else ops.silu_and_mul(x), self.weight, bias)
        return all_reduce(y) if tp_size() > 1 else y


def copy_weight(dst: torch.Tensor, src) -> None:
    """Copy a checkpoint tensor (or this rank's narrowed part of it) into a parameter. A lazy
    checkpoint tensor that reaches here whole is read whole: the parameter is replicated."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"checkpoint tensor {tuple(src.shape)} does not fit {tuple(dst.shape)}")
    dst.copy_(src if isinstance(src, torch.Tensor) else src.read())


def choose_small_m_kernels(model: nn.Module, device: torch.device) -> dict[str, str]:
    """For each weight shape of the model's linear layers, time a one-row product through every
    layer of that shape (so weights stream from memory, as in a decode step) with cuBLAS and with
    the Triton GEMV, each replayed in a CUDA graph, and route one-row inputs of that shape to
    the faster. A layer that fuses the RMSNorm before it or an activation into the GEMV is timed
    with that fusion, cuBLAS paying for the separate kernel. cuBLAS picks poor kernels for some
    narrow shapes at M = 1 (on an H200, Qwen3-0.6B's 1024 x 2048 o_proj: 10.7 us against
    3.1 us) and wins on others. Returns {"[rmsnorm+]NxK[+act]": "gemv" | "cublas"}."""
    if device.type != "cuda" or os.environ.get(SMALL_M_ENV, "auto") == "cublas":
        return {}
    groups: dict[tuple, list[LinearBase]] = defaultdict(list)
    for module in model.modules():
        if isinstance(module, LinearBase) and module.weight.dtype != torch.float32:
            key = (*module.weight.shape, module.fused_act, module.norm_before)
            groups[key].append(module)
    choice = {}
    for (n, k, act, norm_before), layers in groups.items():
        cublas_one, gemv_one = _one_row_paths(k, act, norm_before, layers[0].weight)
        cublas = _graph_time(lambda: [cublas_one(m.weight) for m in layers])  # noqa: B023
        gemv = _graph_time(lambda: [gemv_one(m.weight) for m in layers])  # noqa: B023
        use = gemv < 0.97 * cublas  # a clear win only: timings carry a little noise
        for m in layers:
            m.gemv = use
        key = ("rmsnorm+" if norm_before else "") + f"{n}x{k}" + (f"+{act}" if act else "")
        choice[key] = "gemv" if use else "cublas"
        log.info(
            "one-row %s projections (%d layers): cuBLAS %.1f us, GEMV %.1f us -> %s",
            key,
            len(layers),
            cublas * 1e3 / len(layers),
            gemv * 1e3 / len(layers),
            choice[key],
        )
    return choice


def _one_row_paths(k: int, act: str | None, norm_before: bool, like: torch.Tensor):
    """(cuBLAS path, GEMV path) of a one-row product with a weight, each a function of the
    weight, with what the layer fuses in front (add + RMSNorm, or an activation)."""
    x = torch.randn(1, 2 * k if act else k, dtype=like.dtype, device=like.device)
    if norm_before:
        residual = torch.randn_like(x)
        norm_w = torch.ones(k, dtype=like.dtype, device=like.device)
        return (
            lambda w: F.linear(ops.fused_add_rms_norm(x, residual, norm_w, 1e-6)[0], w),
            lambda w: ops.rms_norm_linear_small_m(x, residual, norm_w, 1e-6, w),
        )
    if act is not None:
        return (
            lambda w: F.linear(ops.silu_and_mul(x), w),
            lambda w: ops.linear_small_m(x, w, act=act),
        )
    return lambda w: F.linear(x, w), lambda w: ops.linear_small_m(x, w)


def _graph_time(fn, replays: int = 5) -> float:
    """Milliseconds per call of fn, captured once in a CUDA graph and replayed."""
    with torch.inference_mode():
        fn()  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        elapsed = start.elapsed_time(end) / replays
    del graph
    return elapsed

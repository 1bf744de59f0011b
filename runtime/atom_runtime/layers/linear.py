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
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from atom_kernels import ops
from atom_runtime.distributed import all_reduce, tp_rank, tp_size

if TYPE_CHECKING:
    from atom_runtime.layers.norm import RMSNorm  # it imports this module

log = logging.getLogger(__name__)
# "auto" (default): time the paths per layer group at start-up; "cublas": always cuBLAS;
# "gemv": always the Triton GEMV, on the most fused path a layer has (`small_m_paths`' last).
SMALL_M_ENV = "ATOM_SMALL_M_KERNELS"


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
        # Whether the model calls this layer through `forward_normed` (an RMSNorm before it),
        # and the activation applied to its output ("silu_mul": SwiGLU over [gate; up] rows).
        self.norm_before = False
        self.act_after: str | None = None
        # A qkv projection whose attention applies rotary and stores k/v right after it (no
        # QK-norm in between): the GEMV can do both in its epilogue.
        self.rope_after = False
        # One-row inputs (batch-1 decode) go to the Triton GEMV when it won for this layer's
        # group at start-up (`choose_small_m_kernels`), with the norm, the activation or the
        # rotary + cache store fused into it when `fuse_norm` / `fuse_act` / `fuse_rope` (else
        # each in its own kernel).
        self.gemv = False
        self.fuse_norm = False
        self.fuse_act = False
        self.fuse_rope = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """act_after(x @ W.T + b)."""
        if self.gemv and x.shape[0] == 1:
            fused = self.act_after if self.fuse_act else None
            y = ops.linear_small_m(x, self.weight, self._bias(), act=fused)
            return y if fused is not None else self._activate(y)
        return self._activate(F.linear(x, self.weight, self._bias()))

    def forward_normed(self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm):
        """`norm` (an RMSNorm, adding `residual` first when given), then this layer. Returns
        (output, residual after the add; x itself without a residual). A one-row x runs the
        norm inside the GEMV when the layer's group chose that."""
        if self.gemv and self.fuse_norm and x.shape[0] == 1:
            fused = self.act_after if self.fuse_act else None
            y, residual = ops.rms_norm_linear_small_m(
                x, residual, norm.weight, norm.eps, self.weight, self._bias(), act=fused
            )
            return (y if fused is not None else self._activate(y)), residual
        normed, residual = norm.with_residual(x, residual)
        return self(normed), residual

    def fuses_rope(self, x: torch.Tensor) -> bool:
        """Whether this input goes through the GEMV with rotary and the cache store in its
        epilogue (the attention then calls `PagedAttention.prepare_one_row`)."""
        return self.rope_after and self.gemv and self.fuse_rope and x.shape[0] == 1

    def _bias(self) -> torch.Tensor | None:
        return self.bias

    def _activate(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.act_after is None else ops.silu_and_mul(y)

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return all_reduce(y) if tp_size() > 1 else y

    def _bias(self) -> torch.Tensor | None:
        return self.bias if tp_rank() == 0 else None  # added once, before the sum across ranks


def copy_weight(dst: torch.Tensor, src) -> None:
    """Copy a checkpoint tensor (or this rank's narrowed part of it) into a parameter. A lazy
    checkpoint tensor that reaches here whole is read whole: the parameter is replicated."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"checkpoint tensor {tuple(src.shape)} does not fit {tuple(dst.shape)}")
    dst.copy_(src if isinstance(src, torch.Tensor) else src.read())


def small_m_mode() -> str:
    """ATOM_SMALL_M_KERNELS: "auto" (the default), "cublas" or "gemv"."""
    mode = os.environ.get(SMALL_M_ENV, "auto").strip().lower() or "auto"
    if mode not in ("auto", "cublas", "gemv"):
        raise ValueError(f"{SMALL_M_ENV}={mode!r}: expected auto, cublas or gemv")
    return mode


def small_m_groups(model: nn.Module) -> dict[str, list[LinearBase]]:
    """The model's half-precision linear layers grouped by what a one-row product through them
    is: "[rmsnorm+]NxK[+act]" (the norm before it, the weight shape, the activation after)."""
    groups: dict[str, list[LinearBase]] = defaultdict(list)
    for module in model.modules():
        if isinstance(module, LinearBase) and module.weight.dtype != torch.float32:
            n, k = module.weight.shape
            norm = "rmsnorm+" if module.norm_before else ""
            act = f"+{module.act_after}" if module.act_after else ""
            groups[f"{norm}{n}x{k}{act}"].append(module)
    return groups


def small_m_paths(layer: LinearBase) -> list[str]:
    """The one-row paths a layer can take: "cublas", "gemv", and the GEMV with what the layer
    has around it fused in: "gemv+norm", "gemv+act", "gemv+norm+act", "gemv+rope"."""
    paths = ["cublas", "gemv"]
    if layer.norm_before:
        paths.append("gemv+norm")
    if layer.rope_after:
        paths.append("gemv+rope")
    if layer.act_after is not None:
        paths.append("gemv+act")
        if layer.norm_before:
            paths.append("gemv+norm+act")
    return paths


def use_small_m_path(layers: list[LinearBase], path: str) -> None:
    for m in layers:
        m.gemv = path != "cublas"
        m.fuse_norm = "+norm" in path
        m.fuse_act = "+act" in path
        m.fuse_rope = "+rope" in path


def choose_small_m_kernels(model: nn.Module, device: torch.device) -> dict[str, str]:
    """For each group of linear layers (`small_m_groups`), time a one-row product through every
    layer of the group (so weights stream from memory, as in a decode step) along each of its
    paths (`small_m_paths`: cuBLAS, the Triton GEMV, the GEMV with the norm before it, the
    activation after it or the rotary + cache store after it fused in), each replayed in a CUDA
    graph, the unfused ones paying for those kernels of their own; the layers take the
    fastest. A path whose kernels fail to build is left out. cuBLAS picks poor kernels for some
    narrow shapes at M = 1 (on an H200, Qwen3-0.6B's 1024 x 2048 o_proj: 10.7 us against
    3.1 us) and wins on others; a fused prologue can cost more than the launch it saves (every
    program recomputes it). Alone, a projection can time differently than inside a decode
    step: the model runner then checks the choices on the whole step
    (`ModelRunner._refine_small_m_kernels`). Returns {group: path}."""
    mode = small_m_mode()
    if device.type != "cuda" or mode == "cublas":
        return {}
    choice = {}
    for key, layers in small_m_groups(model).items():
        paths = small_m_paths(layers[0])
        if mode == "gemv":
            choice[key] = paths[-1]
            use_small_m_path(layers, paths[-1])
            continue
        fns = _one_row_paths(layers[0])
        usable = []
        for path in paths:
            try:
                fns[path](layers[0].weight)  # builds its kernels
                torch.cuda.synchronize()
                usable.append(path)
            except Exception as exc:  # a kernel this GPU's Triton cannot build or run
                if path == "cublas":
                    raise
                log.warning("one-row %s: the %s path failed (%s); not used", key, path, exc)
        times = graph_times(
            *(lambda fn=fns[p]: [fn(m.weight) for m in layers] for p in usable)  # noqa: B023
        )
        timed = dict(zip(usable, times, strict=True))
        choice[key] = min(timed, key=timed.get)
        use_small_m_path(layers, choice[key])
        log.info(
            "one-row %s projections (%d layers): %s -> %s",
            key,
            len(layers),
            ", ".join(f"{path} {t * 1e3 / len(layers):.1f} us" for path, t in timed.items()),
            choice[key],
        )
    return choice


def _one_row_paths(layer: LinearBase) -> dict:
    """{path name: function of a weight}: a one-row product with that weight along each of the
    layer's paths, with the add + RMSNorm before it, the activation after it, and the rotary +
    cache store after a qkv projection that the layer has, each in its own kernel or fused into
    the GEMV as the path says."""
    like, act = layer.weight, layer.act_after
    k = like.shape[1]
    x = torch.randn(1, k, dtype=like.dtype, device=like.device)
    residual = torch.randn_like(x)
    norm_w = torch.ones(k, dtype=like.dtype, device=like.device)
    rope = _rope_target(layer) if layer.rope_after else None

    def path_fn(path: str):
        fuse_norm, fuse_act, fuse_rope = "+norm" in path, "+act" in path, "+rope" in path

        def run(w):
            if fuse_norm:
                y = ops.rms_norm_linear_small_m(
                    x, residual, norm_w, 1e-6, w, act=act if fuse_act else None
                )[0]
            else:
                h = ops.fused_add_rms_norm(x, residual, norm_w, 1e-6)[0] if layer.norm_before else x
                if path == "cublas":
                    y = F.linear(h, w)
                elif fuse_rope:
                    return ops.linear_rope_store_small_m(h, w, None, *rope)
                else:
                    y = ops.linear_small_m(h, w, act=act if fuse_act else None)
            if rope is not None:
                ops.qk_norm_rope_store_(y, rope[0], rope[1], None, None, 0.0, *rope[2:])
            return ops.silu_and_mul(y) if act is not None and not fuse_act else y

        return run

    return {path: path_fn(path) for path in small_m_paths(layer)}


def _rope_target(layer: LinearBase) -> tuple:
    """Stand-ins for what a qkv projection's rotary + cache store touches, for timing:
    (positions, cos/sin table, k cache, v cache, slot mapping, heads, kv heads, head_dim)."""
    dev, dtype = layer.weight.device, layer.weight.dtype
    heads, kv_heads, dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
    cache = (4, 16, kv_heads, dim)
    return (
        torch.tensor([3], device=dev),
        torch.rand(8, dim, device=dev),
        torch.zeros(cache, dtype=dtype, device=dev),
        torch.zeros(cache, dtype=dtype, device=dev),
        torch.tensor([5], device=dev),
        heads,
        kv_heads,
        dim,
    )


def graph_time(fn, replays: int = 5) -> float:
    """Milliseconds per call of fn, captured once in a CUDA graph and replayed."""
    return graph_times(fn, replays=replays)[0]


def graph_times(*fns, replays: int = 5, rounds: int = 3) -> list[float]:
    """Milliseconds per call of each fn, each captured once in a CUDA graph; the graphs are
    replayed in turn for several rounds and each keeps its best round, so a clock or
    neighbour's hiccup during one measurement does not decide between near-equal paths."""
    graphs = []
    with torch.inference_mode():
        for fn in fns:
            fn()  # compile outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            graph.replay()
            graphs.append(graph)
        torch.cuda.synchronize()
        best = [float("inf")] * len(fns)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(rounds):
            for i, graph in enumerate(graphs):
                start.record()
                for _ in range(replays):
                    graph.replay()
                end.record()
                end.synchronize()
                best[i] = min(best[i], start.elapsed_time(end) / replays)
    del graphs
    return best

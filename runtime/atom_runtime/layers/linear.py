"""Linear layers that know how they are split across tensor-parallel ranks.

Each parameter carries a `weight_loader(param, loaded, shard_id=None)` that copies this rank's part
of a checkpoint tensor into place, so a rank never holds the full model. `loaded` is a tensor or a
lazy checkpoint tensor (`models.loader.CheckpointTensor`): the loader narrows it to this rank's
rows or columns before anything is read, so a rank reads only its shard from disk. Where a
checkpoint part goes is one rule per layer class (`placement`), shared by the weight, its bias and
an FP8 weight's scales (layers/fp8_linear.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atom_kernels import ops
from atom_runtime.layers import fp8_linear
from atom_runtime.layers.forward_context import dense_rows
from atom_runtime.layers.norm import RMSNorm
from atom_runtime.layers.weights import copy_weight
from atom_runtime.system.distributed import all_reduce, tp_rank, tp_size

# The most rows the few-row product (`ops.linear_few_rows`) takes.
FEW_ROWS = 16


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
        # FP8 weights (layers/fp8_linear.py): the dequantization scales beside the FP8 weight and,
        # for static activations, the input's; None for a layer in the run dtype.
        self.register_parameter("weight_scale", None)
        self.register_parameter("input_scale", None)
        self.fp8_scheme = None
        self.weight_block_size: tuple[int, int] | None = None
        # Whether the quantization may make this layer FP8 (not a router, whose logits decide
        # near-ties, nor a weight read in parts elsewhere), and whether an FP8 checkpoint's
        # tensors can load into it as they are (not when its loader reorders rows).
        self.quantizable = True
        self.loads_fp8_checkpoint = True
        # Whether the model calls this layer through `forward_normed` (an RMSNorm before it),
        # and the activation applied to its output ("silu_mul": SwiGLU over [gate; up] rows).
        self.norm_before = False
        self.act_after: str | None = None
        # A qkv projection whose attention applies rotary and stores k/v right after it, with
        # QK-norm before rotary when `qk_norm_after`: the GEMV can do all of it in its epilogue.
        self.rope_after = False
        self.qk_norm_after = False
        # A qkv projection whose output attention may pad for its dense path of fresh prompts:
        # its output then has `forward_context.dense_rows` rows, zeros past the input's.
        self.pads_for_attention = False
        # One-row inputs (batch-1 decode) go to the Triton GEMV when it won for this layer's
        # group at start-up (worker/kernel_choice.py), with the norm, the activation or the
        # rotary + cache store fused into it when `fuse_norm` / `fuse_act` / `fuse_rope` (else
        # each in its own kernel).
        self.gemv = False
        # Inputs of 2..16 rows (a speculative verify step at batch 1) go to the few-row Triton
        # product (`ops.linear_few_rows`) when it won for this layer's group at start-up.
        self.gemv_rows = False
        self.fuse_norm = False
        self.fuse_act = False
        self.fuse_rope = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """act_after(x @ W.T + b)."""
        if self.gemv and x.shape[0] == 1:
            fused = self.act_after if self.fuse_act else None
            y = ops.linear_small_m(x, self.weight, self._bias(), act=fused, **self.gemv_scales())
            return y if fused is not None else self._activate(y)
        if self.gemv_rows and 1 < x.shape[0] <= FEW_ROWS:
            return ops.linear_few_rows(x, self.weight, self._bias(), act=self.act_after)
        if self.pads_for_attention and (rows := dense_rows()) > x.shape[0]:
            return self._padded_linear(x, rows)
        return self._activate(self._matmul(x))

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T (+ b): cuBLAS, or W8A8 for an FP8 weight."""
        if self.weight_scale is None:
            return F.linear(x, self.weight, self._bias())
        return ops.fp8_linear(
            x, self.weight, self.weight_scale, self._bias(), input_scale=self.input_scale,
            weight_block_size=self.weight_block_size,
        )  # fmt: skip

    def gemv_scales(self) -> dict:
        """The FP8 keywords of the batch-1 GEMV ops for this layer's weight (none in the run
        dtype)."""
        if self.weight_scale is None:
            return {}
        return {"weight_scale": self.weight_scale, "weight_block_size": self.weight_block_size}

    def _padded_linear(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        """x @ W.T (+ b) as the first x.shape[0] rows of a `rows`-row buffer whose other rows
        are zeros (the dense attention path's padding, taken in place)."""
        out = torch.empty(rows, self.weight.shape[0], dtype=x.dtype, device=x.device)
        y = out[: x.shape[0]]
        bias = self._bias()
        if self.weight_scale is not None:
            y.copy_(self._matmul(x))
        elif bias is None:
            torch.mm(x, self.weight.t(), out=y)
        else:
            torch.addmm(bias, x, self.weight.t(), out=y)
        out[x.shape[0] :].zero_()
        return y

    def forward_normed(self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm):
        """`norm` (an RMSNorm, adding `residual` first when given), then this layer. Returns
        (output, residual after the add; x itself without a residual). A one-row x runs the norm
        inside the GEMV when the layer's group chose that."""
        if self.gemv and self.fuse_norm and x.shape[0] == 1:
            fused = self.act_after if self.fuse_act else None
            y, residual = ops.rms_norm_linear_small_m(
                x, residual, norm.weight, norm.eps, self.weight, self._bias(), act=fused,
                **self.gemv_scales(),
            )  # fmt: skip
            return (y if fused is not None else self._activate(y)), residual
        normed, residual = norm.with_residual(x, residual)
        return self(normed), residual

    def fuses_rope(self, x: torch.Tensor) -> bool:
        """Whether this input goes through the GEMV with rotary and the cache store in its
        epilogue (the attention then calls `PagedAttention.prepare_one_row`)."""
        return self.rope_after and self.gemv and self.fuse_rope and x.shape[0] == 1

    def _bias(self) -> torch.Tensor | None:
        return self.bias

    def dense_weight(self) -> torch.Tensor:
        """The weight as a plain [out, in] matrix in the run dtype, for code that multiplies by
        parts of it itself (MLA's absorbed W_UK / W_UV are views of kv_b_proj's). A quantized
        layer returns its dequantized weight here."""
        if self.weight_scale is not None:
            return fp8_linear.dense_weight(self)
        return self.weight

    def _activate(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.act_after is None else ops.silu_and_mul(y)

    def shard_ids(self) -> list:
        """The checkpoint parts this layer is built from (None: one tensor)."""
        return [None]

    def placement(self, shard_id=None) -> tuple[int, int, int | None, int]:
        """Where checkpoint part `shard_id` goes: (dim, offset in this layer, offset in the
        checkpoint tensor or None when the whole tensor is this rank's, length), along the
        weight's rows (dim 0) or columns (dim 1)."""
        return 0, 0, None, self.weight.shape[0]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """This rank's part of checkpoint part `shard_id` into `param` (the weight or the bias:
        a bias follows the rows, and is whole when the layer splits columns)."""
        dim, dst, src, size = self.placement(shard_id)
        if param.data.dim() == 1 and dim == 1:
            copy_weight(param.data, loaded)
            return
        part = loaded if src is None else loaded.narrow(dim, src, size)
        copy_weight(param.data.narrow(dim, dst, size), part)


class MergedReplicatedLinear(LinearBase):
    """Several projections every rank holds whole, stored as one (MLA's q_a and kv_a): shard i
    is output_sizes[i] rows."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias)

    def shard_ids(self) -> list:
        return list(range(len(self.output_sizes)))

    def placement(self, shard_id=None) -> tuple[int, int, int | None, int]:
        return 0, sum(self.output_sizes[:shard_id]), None, self.output_sizes[shard_id]


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication in forward."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        self.out_per_rank = _divide(out_features, tp_size(), "output features")
        super().__init__(in_features, self.out_per_rank, bias)

    def placement(self, shard_id=None) -> tuple[int, int, int, int]:
        n = self.out_per_rank
        return 0, 0, tp_rank() * n, n


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections stored as one (gate_up): shard i is output_sizes[i]."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias)

    def shard_ids(self) -> list:
        return list(range(len(self.output_sizes)))

    def placement(self, shard_id=None) -> tuple[int, int, int, int]:
        size = self.output_sizes[shard_id] // tp_size()
        offset = sum(self.output_sizes[:shard_id]) // tp_size()
        return 0, offset, tp_rank() * size, size


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

    def shard_ids(self) -> list:
        return ["q", "k", "v"]

    def placement(self, shard_id=None) -> tuple[int, int, int, int]:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        if shard_id == "q":
            return 0, 0, tp_rank() * q_size, q_size
        offset = q_size if shard_id == "k" else q_size + kv_size
        return 0, offset, (tp_rank() // self.kv_replicas) * kv_size, kv_size


class RowParallelLinear(LinearBase):
    """Input features split across ranks; one all-reduce of the output (left to the caller
    when `reduce_results` is False: it sums this partial with others first)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        self.in_per_rank = _divide(in_features, tp_size(), "input features")
        super().__init__(self.in_per_rank, out_features, bias)
        self.reduce_results = True

    def placement(self, shard_id=None) -> tuple[int, int, int, int]:
        n = self.in_per_rank  # columns; the bias is whole (added once, after the reduce)
        return 1, 0, tp_rank() * n, n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return all_reduce(y) if tp_size() > 1 and self.reduce_results else y

    def _bias(self) -> torch.Tensor | None:
        return self.bias if tp_rank() == 0 else None  # added once, before the sum across ranks

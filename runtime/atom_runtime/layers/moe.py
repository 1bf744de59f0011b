"""Sparse mixture-of-experts: a router, the experts run by the fused MoE op, and an optional
shared expert. The one MoE layer every family here uses (Qwen3-MoE, Mixtral, GPT-OSS, Qwen3.5-MoE,
Qwen3-Next); what differs between them is an `MoESpec` and how their checkpoints store the
experts (each family's loader fills `w13` / `w2` through `load_expert` or `load_stacked`).

Tensor parallelism splits each expert's intermediate dimension: every rank holds every expert's
slice, and the partial outputs are summed across ranks (one all-reduce). The router, the shared
expert's gate and the down projection's bias are replicated; the bias is added on rank 0 only,
so the sum counts it once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from atom_kernels import ops
from atom_runtime.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    RowParallelLinear,
    _divide,
)
from atom_runtime.layers.weights import copy_weight
from atom_runtime.system.distributed import all_reduce, tp_rank, tp_size

EXPERT_ACTIVATIONS = ("silu", "swiglu_clamped")


@dataclass(frozen=True)
class MoESpec:
    """The shape and arithmetic of one MoE layer."""

    hidden_size: int
    num_experts: int
    top_k: int
    intermediate_size: int  # of one routed expert
    renormalize: bool = True  # rescale the top-k routing weights to sum 1 (norm_topk_prob)
    shared_intermediate_size: int = 0  # 0: no shared expert
    router_bias: bool = False  # the router is Linear with a bias (GPT-OSS)
    expert_bias: bool = False  # gate/up and down carry a per-expert bias (GPT-OSS)
    activation: str = "silu"  # see ops.fused_moe
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0


class DenseMLP(nn.Module):
    """SwiGLU MLP (gate_up, silu(gate) * up, down): a dense layer or a shared expert."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2)
        self.gate_up_proj.act_after = "silu_mul"
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x))


class SparseMoE(nn.Module):
    """Top-k softmax routing over experts (fused MoE op), plus an optional shared expert scaled
    by sigmoid(shared_expert_gate(x)).

    A shared expert as wide as a routed one (Qwen3-Next, Qwen3.5-MoE) is stacked after them as
    expert E: its gate is the router's row E, its weights the experts' slot E, and `moe_topk`
    gives every token a last pair (E, sigmoid(logit E)). One router launch and one fused MoE
    call then serve both, and one all-reduce under TP. A narrower or wider one stays a
    DenseMLP beside the experts."""

    # The checkpoint tensors a stacked shared expert is built from (per MoE layer, under mlp.).
    STACKED_TENSORS = (
        "gate.weight",
        "shared_expert_gate.weight",
        "shared_expert.gate_proj.weight",
        "shared_expert.up_proj.weight",
        "shared_expert.down_proj.weight",
    )

    def __init__(self, spec: MoESpec) -> None:
        super().__init__()
        if spec.activation not in EXPERT_ACTIVATIONS:
            raise ValueError(
                f"expert activation {spec.activation!r}: not one of {EXPERT_ACTIVATIONS}"
            )
        e, h = spec.num_experts, spec.hidden_size
        self.spec = spec
        self.num_experts, self.top_k = e, spec.top_k
        self.renormalize = spec.renormalize
        self.inter_all = spec.intermediate_size
        self.inter = _divide(spec.intermediate_size, tp_size(), "moe_intermediate_size")
        shared = spec.shared_intermediate_size
        self.stacked_shared = shared > 0 and shared == spec.intermediate_size
        slots = e + 1 if self.stacked_shared else e
        self.gate = LinearBase(h, slots, bias=spec.router_bias)
        self.gate.quantizable = False  # the router: FP8 noise would move near-tied experts
        self.w13 = nn.Parameter(torch.empty(slots, 2 * self.inter, h), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(slots, h, self.inter), requires_grad=False)
        if spec.expert_bias:
            self.w13_bias = nn.Parameter(torch.empty(slots, 2 * self.inter), requires_grad=False)
            self.w2_bias = nn.Parameter(torch.empty(slots, h), requires_grad=False)
        else:
            self.w13_bias = self.w2_bias = None
        if shared and not self.stacked_shared:
            self.shared_expert = DenseMLP(h, shared)
            self.shared_expert_gate = LinearBase(h, 1, bias=False)
            self.shared_expert_gate.quantizable = False
        else:
            self.shared_expert = self.shared_expert_gate = None
        # Checkpoint tensors that fill parts of the stacked parameters (a missing one would
        # leave its slot unset behind a parameter that counts as loaded).
        self.stacked_loaded: set[str] = set()

    def load_experts(self, name: str, loaded) -> str:
        """`gate_up_proj` / `down_proj` (all experts fused: [E, 2I, H] gate rows then up rows,
        [E, H, I]) or `{e}.{gate,up,down}_proj.weight`; returns the parameter loaded."""
        i, r = self.inter, tp_rank()
        e = self.num_experts
        if name == "gate_up_proj":
            self.load_gate_up(
                loaded.narrow(1, r * i, i), loaded.narrow(1, self.inter_all + r * i, i)
            )
            return "w13"
        if name == "down_proj":
            copy_weight(self.w2.data[:e], loaded.narrow(2, r * i, i))
            return "w2"
        m = re.fullmatch(r"(\d+)\.(gate_proj|up_proj|down_proj)\.weight", name)
        if m is None or int(m.group(1)) >= e:
            raise ValueError(f"mlp.experts.{name}: not an expert tensor of this model")
        self.load_expert(int(m.group(1)), m.group(2), loaded)
        return "w2" if m.group(2) == "down_proj" else "w13"

    def load_gate_up(self, gate, up, bias: bool = False) -> None:
        """Every routed expert's gate and up rows of this rank ([E, I/tp, H] each), or with
        `bias` their biases ([E, I/tp] each)."""
        e, i = self.num_experts, self.inter
        target = self.w13_bias if bias else self.w13
        copy_weight(target.data[:e, :i], gate)
        copy_weight(target.data[:e, i:], up)

    def load_down(self, down, bias: bool = False) -> None:
        """Every routed expert's down projection, this rank's columns ([E, H, I/tp]), or with
        `bias` its bias ([E, H], whole: added on rank 0 only)."""
        copy_weight((self.w2_bias if bias else self.w2).data[: self.num_experts], down)

    def load_stacked_shared(self, name: str, loaded) -> str:
        """The stacked shared expert's tensors (`shared_expert.{gate,up,down}_proj.weight`,
        `shared_expert_gate.weight`) and the router (`gate.weight`, rows [0, E)); returns the
        parameter loaded."""
        e = self.num_experts
        self.stacked_loaded.add(name)
        if name == "gate.weight":
            copy_weight(self.gate.weight.data[:e], loaded)
            return "gate.weight"
        if name == "shared_expert_gate.weight":
            copy_weight(self.gate.weight.data[e:], loaded)
            return "gate.weight"
        m = re.fullmatch(r"shared_expert\.(gate_proj|up_proj|down_proj)\.weight", name)
        if m is None:
            raise ValueError(f"mlp.{name}: not a tensor of this layer's MoE")
        self.load_expert(e, m.group(1), loaded)
        return "w2" if m.group(1) == "down_proj" else "w13"

    def load_expert(self, e: int, which: str, loaded) -> None:
        """One expert's gate, up or down projection into slot e (this rank's columns)."""
        i, r = self.inter, tp_rank()
        if which == "down_proj":
            copy_weight(self.w2.data[e], loaded.narrow(1, r * i, i))
        else:
            rows = slice(0, i) if which == "gate_proj" else slice(i, 2 * i)
            copy_weight(self.w13.data[e, rows], loaded.narrow(0, r * i, i))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = ops.moe_topk(self.gate(x), self.top_k, self.renormalize, self.stacked_shared)
        spec = self.spec
        y = ops.fused_moe(
            x, self.w13, self.w2, weights, ids, self.w13_bias,
            self.w2_bias if tp_rank() == 0 else None, spec.activation, spec.swiglu_alpha,
            spec.swiglu_limit,
        )  # fmt: skip
        if tp_size() > 1:
            y = all_reduce(y)
        if self.shared_expert is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y


def load_routed_expert(model: nn.Module, name: str, tensor) -> str | None:
    """A routed expert's checkpoint tensor (`model.layers.N.mlp.experts.*`, fused or one per
    expert) into its layer's `SparseMoE`; returns the parameter loaded, None for any other."""
    m = re.fullmatch(r"(model\.layers\.\d+\.mlp)\.experts\.(.+)", name)
    if m is None:
        return None
    moe = model.get_submodule(m.group(1))
    if not isinstance(moe, SparseMoE):
        raise ValueError(f"checkpoint tensor {name!r}: layer has no experts here")
    return f"{m.group(1)}.{moe.load_experts(m.group(2), tensor)}"

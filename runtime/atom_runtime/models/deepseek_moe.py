"""DeepSeek's mixture of experts: routed experts picked by grouped top-k, plus shared experts
every token runs.

Routing (`grouped_topk`, fp32): scores are sigmoid(logits) (V3) or softmax(logits) (V2); with
grouping, the experts are cut into `n_group` groups ranked by their best score (V2's
group_limited_greedy) or by the sum of their two best scores after adding
`e_score_correction_bias` (V3's noaux_tc), and only the `topk_group` best groups compete; the
top-k experts' weights are their scores (without the bias), renormalized to sum 1 when
`norm_topk_prob`, times `routed_scaling_factor`. Plain torch ops, no host sync (CUDA-graph
capturable); a fused routing kernel is later work.

The router's weight and the correction bias stay in fp32 whatever the run dtype (transformers
keeps both in fp32 and routes in fp32), so near-ties are decided as the reference decides them.
Tensor parallelism splits each expert's and the shared experts' intermediate dimension; the
routed and shared partial outputs are summed and all-reduced once.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from atom_kernels import ops
from atom_runtime.layers.moe import DenseMLP, SparseMoE
from atom_runtime.models.config import ModelConfig
from atom_runtime.models.mla_config import GroupedTopkRouting
from atom_runtime.system.distributed import all_reduce, tp_size


def grouped_topk(
    logits: torch.Tensor,
    top_k: int,
    routing: GroupedTopkRouting,
    renormalize: bool,
    correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, top_k], expert ids int32 [T, top_k]) from fp32 router logits [T, E]."""
    if routing.scoring_func == "sigmoid":
        scores = logits.sigmoid()
    else:
        scores = logits.softmax(dim=-1)
    choice = scores if correction_bias is None else scores + correction_bias
    if routing.grouped:
        tokens, experts = choice.shape
        per_group = experts // routing.n_group
        groups = choice.view(tokens, routing.n_group, per_group)
        if routing.topk_method == "noaux_tc":
            group_scores = groups.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_scores = groups.amax(dim=-1)
        best = group_scores.topk(routing.topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        choice = choice.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routing.routed_scaling_factor, ids.to(torch.int32)


class GroupedTopkMoE(SparseMoE):
    """Routed experts (`SparseMoE`'s stacked w13 / w2 and its checkpoint loading, fused MoE op)
    chosen by `grouped_topk`, plus `n_shared_experts` shared experts as one dense MLP."""

    def __init__(self, cfg: ModelConfig) -> None:
        if cfg.routing is None:
            raise ValueError("GroupedTopkMoE needs a config with grouped top-k routing")
        super().__init__(replace(cfg.moe_spec(), shared_intermediate_size=0))
        self.routing = cfg.routing
        self.gate.weight.keep_fp32 = True
        if self.routing.correction_bias:
            bias = nn.Parameter(torch.zeros(cfg.num_experts), requires_grad=False)
            bias.keep_fp32 = True
            self.gate.e_score_correction_bias = bias  # checkpoint: mlp.gate.e_score_correction_bias
        shared = cfg.moe_intermediate_size * self.routing.n_shared_experts
        self.shared_experts = DenseMLP(cfg.hidden_size, shared) if shared else None
        if self.shared_experts is not None:
            self.shared_experts.down_proj.reduce_results = False  # summed with the routed part

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x.float(), self.gate.weight)
        bias = getattr(self.gate, "e_score_correction_bias", None)
        weights, ids = grouped_topk(logits, self.top_k, self.routing, self.renormalize, bias)
        y = ops.fused_moe(x, self.w13, self.w2, weights, ids)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return all_reduce(y) if tp_size() > 1 else y

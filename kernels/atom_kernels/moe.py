"""Triton fused MoE for SwiGLU experts: the (token, choice) pairs sorted by expert and padded
per expert to whole BLOCK_M blocks, then two grouped GEMMs in which each program owns one
block of one expert (no loop over experts anywhere):

1. gate/up: `inter[p] = silu(x[t] @ w13[e, :I]^T) * (x[t] @ w13[e, I:]^T)` for pair p = (t, j);
2. down: `out[p] = topk_weights[p] * (inter[p] @ w2[e]^T)`; then `y[t] = sum_j out[(t, j)]`.

The sort runs on the device with a launch grid sized by an upper bound on the block count, so
nothing waits on the host (CUDA-graph capturable); blocks past the real count exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _moe_gate_up_kernel(
    x_ptr,
    w_ptr,
    inter_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    num_pairs,
    num_experts,
    hidden,
    inter_size,
    x_stride,
    w_stride_e,
    w_stride_n,
    inter_stride,
    TOP_K: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    expert = tl.load(block_expert_ptr + tl.program_id(0))
    if expert >= num_experts:
        return  # a block past the last expert's padded rows
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pairs_ptr + rows)
    valid = pair < num_pairs
    token = (pair // TOP_K).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < inter_size
    kk = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert.to(tl.int64) * w_stride_e
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = (k0 + kk) < hidden
        a = tl.load(
            x_ptr + token[:, None] * x_stride + (k0 + kk)[None, :],
            mask=valid[:, None] & k_ok[None, :],
            other=0.0,
        )
        w_mask = k_ok[:, None] & n_ok[None, :]
        w_cols = (k0 + kk)[:, None] + n[None, :].to(tl.int64) * w_stride_n  # [BLOCK_K, BLOCK_N]
        wg = tl.load(w_base + w_cols, mask=w_mask, other=0.0)
        wu = tl.load(w_base + inter_size * w_stride_n + w_cols, mask=w_mask, other=0.0)
        if IEEE:
            gate += tl.dot(a, wg, input_precision="ieee")
            up += tl.dot(a, wu, input_precision="ieee")
        else:
            gate += tl.dot(a, wg)
            up += tl.dot(a, wu)
    act = gate / (1.0 + tl.exp(-gate)) * up
    out = inter_ptr + pair.to(tl.int64)[:, None] * inter_stride + n[None, :]
    tl.store(out, act.to(inter_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _moe_down_kernel(
    inter_ptr,
    w_ptr,
    out_ptr,
    weights_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    num_pairs,
    num_experts,
    hidden,
    inter_size,
    inter_stride,
    w_stride_e,
    w_stride_n,
    out_stride,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    expert = tl.load(block_expert_ptr + tl.program_id(0))
    if expert >= num_experts:
        return
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pairs_ptr + rows)
    valid = pair < num_pairs
    pair64 = pair.to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < hidden
    kk = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert.to(tl.int64) * w_stride_e
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter_size, BLOCK_K):
        k_ok = (k0 + kk) < inter_size
        a = tl.load(
            inter_ptr + pair64[:, None] * inter_stride + (k0 + kk)[None, :],
            mask=valid[:, None] & k_ok[None, :],
            other=0.0,
        )
        w = tl.load(
            w_base + (k0 + kk)[:, None] + n[None, :].to(tl.int64) * w_stride_n,
            mask=k_ok[:, None] & n_ok[None, :],
            other=0.0,
        )
        if IEEE:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    acc *= tl.load(weights_ptr + pair, mask=valid, other=0.0)[:, None]
    out = out_ptr + pair64[:, None] * out_stride + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


def sort_pairs_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, choice) pairs grouped by expert, each group padded to whole `block_m` blocks.

    Returns `sorted_pairs` int32 `[num_blocks * block_m]` (pair index `t * K + j`, or the pair
    count as padding) and `block_expert` int32 `[num_blocks]` (the expert of each block, or
    `num_experts` past the last real block). num_blocks is an upper bound computed from shapes
    alone, so no host sync happens."""
    flat = topk_ids.flatten().long()
    num_pairs = flat.shape[0]
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[expert_of]
    dest = (padded_end - padded)[expert_of] + rank
    # Every non-empty expert wastes less than one block, and holds at least one pair.
    num_blocks = min(triton.cdiv(num_pairs, block_m) + num_experts, num_pairs)
    sorted_pairs = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs[dest] = order.to(torch.int32)
    block_start = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_end, block_start, right=True).to(torch.int32)
    return sorted_pairs, block_expert


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """See `atom_kernels.ops.fused_moe`."""
    for name, t in (("x", x), ("w13", w13), ("w2", w2)):
        if t.stride(-1) != 1:
            raise ValueError(f"fused_moe needs {name} with a contiguous last dim")
    num_tokens, hidden = x.shape
    num_experts, inter = w13.shape[0], w2.shape[2]
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    # Few pairs per expert in decode: small row blocks waste less padding.
    block_m = 16 if num_pairs <= 64 * num_experts else 64
    sorted_pairs, block_expert = sort_pairs_by_expert(topk_ids, num_experts, block_m)
    num_blocks = block_expert.shape[0]
    ieee = x.dtype == torch.float32
    inter_buf = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    block_n, block_k = 64, 64
    _moe_gate_up_kernel[(num_blocks, triton.cdiv(inter, block_n))](
        x, w13, inter_buf, sorted_pairs, block_expert, num_pairs, num_experts, hidden, inter,
        x.stride(0), w13.stride(0), w13.stride(1), inter_buf.stride(0),
        TOP_K=top_k, IEEE=ieee, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=4,
    )  # fmt: skip
    out_pairs = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).contiguous()
    _moe_down_kernel[(num_blocks, triton.cdiv(hidden, block_n))](
        inter_buf, w2, out_pairs, weights, sorted_pairs, block_expert, num_pairs, num_experts,
        hidden, inter, inter_buf.stride(0), w2.stride(0), w2.stride(1), out_pairs.stride(0),
        IEEE=ieee, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip
    return out_pairs.view(num_tokens, top_k, hidden).sum(1, dtype=torch.float32).to(x.dtype)

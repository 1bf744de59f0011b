"""Triton fused MoE for SwiGLU experts: the (token, choice) pairs sorted by expert and padded
per expert to whole BLOCK_M blocks, then two grouped GEMMs in which each program owns one
block of one expert (no loop over experts anywhere):

1. gate/up: `inter[p] = silu(x[t] @ w13[e, :I]^T) * (x[t] @ w13[e, I:]^T)` for pair p = (t, j);
2. down: `out[p] = topk_weights[p] * (inter[p] @ w2[e]^T)`; then `y[t] = sum_j out[(t, j)]`.

GPT-OSS's experts add a bias to gate/up and to down and clamp their SwiGLU (`ExpertArith`):
the biases are added to the fp32 accumulators, the activation is `_expert_act`.

The sort runs on the device with a launch grid sized by an upper bound on the block count, so
nothing waits on the host (CUDA-graph capturable); blocks past the real count exit at once.

A step of one token (batch-1 decode) takes the pair GEMV path instead (`fused_moe_gemv`;
ATOM_MOE_GEMV=0 turns it off): no sort; gate/up runs one program per (pair, block of
intermediate columns) streaming its expert's rows against the pair's input row, the way the
batch-1 GEMV streams a dense projection, and down one program per (token, block of hidden
columns) summing the token's pairs. In the grouped GEMMs a decode pair fills one row of a
16-row block, the gate/up launch has only (pairs x I/64) programs (64 for Qwen3.5-35B-A3B's 8
choices and I = 512), too few to stream the 32 MB the step reads, and the sort is about a dozen
small launches a layer. The router (`moe_topk`) is one kernel on every path.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from atom_kernels import envs, pdl
from atom_kernels.pdl import wait_for_inputs

# Steps of at most GEMV_MAX_TOKENS tokens take `fused_moe_gemv` unless ATOM_MOE_GEMV=0 (W2 of
# the Qwen3.5-35B-A3B-shaped hybrid on an H200: 3.193 ms/token with it, 5.269 without). Read once.
MOE_GEMV = envs.MOE_GEMV.enabled()
# Larger steps take the sorted grouped GEMMs; ATOM_MOE_GEMV_MAX_TOKENS raises the limit
# (`benchmarks/moe_gemv_sweep.py --tokens` times both paths at a few tokens).
GEMV_MAX_TOKENS = int(envs.MOE_GEMV_MAX_TOKENS.number())


class ExpertArith(NamedTuple):
    """What the experts add to SwiGLU (GPT-OSS): per-expert biases of gate/up ([E, 2I]) and down
    ([E, H]), and the clamped activation with its gain and limit (`ops.fused_moe`)."""

    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None
    clamped: bool = False
    alpha: float = 1.702
    limit: float = 7.0


PLAIN = ExpertArith()


@triton.jit
def _expert_act(gate, up, CLAMPED: tl.constexpr, alpha, limit):
    """silu(gate) * up, or with CLAMPED GPT-OSS's clamped SwiGLU (`ops.fused_moe`)."""
    if CLAMPED:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        return gate / (1.0 + tl.exp(-alpha * gate)) * (up + 1.0)
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def _moe_gate_up_kernel(
    x_ptr, w_ptr, b_ptr, inter_ptr, sorted_pairs_ptr, block_expert_ptr, num_pairs, num_experts,
    hidden, inter_size, x_stride, w_stride_e, w_stride_n, inter_stride, alpha, limit,
    TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
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
    if HAS_BIAS:
        b_row = b_ptr + expert.to(tl.int64) * 2 * inter_size
        gate += tl.load(b_row + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        up += tl.load(b_row + inter_size + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    act = _expert_act(gate, up, CLAMPED, alpha, limit)
    out = inter_ptr + pair.to(tl.int64)[:, None] * inter_stride + n[None, :]
    tl.store(out, act.to(inter_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _moe_down_kernel(
    inter_ptr, w_ptr, b_ptr, out_ptr, weights_ptr, sorted_pairs_ptr, block_expert_ptr, num_pairs,
    num_experts, hidden, inter_size, inter_stride, w_stride_e, w_stride_n, out_stride,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
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
    if HAS_BIAS:
        bias = tl.load(b_ptr + expert.to(tl.int64) * hidden + n, mask=n_ok, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    acc *= tl.load(weights_ptr + pair, mask=valid, other=0.0)[:, None]
    out = out_ptr + pair64[:, None] * out_stride + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _moe_topk_kernel(
    logits_ptr, weights_ptr, ids_ptr, num_experts, logits_stride, out_stride, TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr, SHARED: tl.constexpr, BLOCK_E: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Program t: softmax over token t's E router logits in fp32, its TOP_K experts (the lowest
    index first among equal probabilities), their weights (rescaled to sum 1 when
    RENORMALIZE); with SHARED, column TOP_K is the shared expert (index E) weighted by the
    sigmoid of logit E."""
    wait_for_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    logits = tl.load(
        logits_ptr + t * logits_stride + e, mask=e < num_experts, other=float("-inf")
    ).to(tl.float32)
    probs = tl.exp(logits - tl.max(logits, axis=0))
    probs = probs / tl.sum(probs, axis=0)
    # A row of NaN or infinite logits (a padded row of a captured batch) still gets TOP_K
    # distinct valid experts: its NaN probabilities count as 0, so the lowest indices win.
    probs = tl.where(probs == probs, probs, 0.0)
    left = tl.where(e < num_experts, probs, -1.0)
    total = tl.sum(tl.zeros([BLOCK_E], dtype=tl.float32), axis=0)
    chosen = tl.zeros([BLOCK_E], dtype=tl.int32)  # the rank + 1 at which each expert was taken
    for j in tl.static_range(TOP_K):
        best = tl.max(left, axis=0)
        idx = tl.min(tl.where(left == best, e, BLOCK_E), axis=0)
        total += best
        chosen = tl.where(e == idx, j + 1, chosen)
        left = tl.where(e == idx, -1.0, left)
    scale = 1.0 / total if RENORMALIZE else 1.0
    rank = chosen - 1
    taken = chosen > 0
    tl.store(weights_ptr + t * out_stride + rank, probs * scale, mask=taken)
    tl.store(ids_ptr + t * out_stride + rank, e, mask=taken)
    if SHARED:
        g = tl.load(logits_ptr + t * logits_stride + num_experts).to(tl.float32)
        tl.store(weights_ptr + t * out_stride + TOP_K, 1.0 / (1.0 + tl.exp(-g)))
        tl.store(ids_ptr + t * out_stride + TOP_K, num_experts)


@triton.jit
def _moe_gemv_gate_up_kernel(
    x_ptr, w_ptr, b_ptr, ids_ptr, inter_ptr, hidden, inter_size, x_stride, w_stride_e, w_stride_n,
    inter_stride, alpha, limit, TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """Program (pair p = (t, j), block of BLOCK_N intermediate columns): the gate and up rows of
    pair p's expert times x[t], fp32 [BLOCK_N, BLOCK_K] accumulators reduced once at the end,
    then SwiGLU; writes inter[p, cols]."""
    wait_for_inputs(PDL)
    pair = tl.program_id(0)
    token = (pair // TOP_K).to(tl.int64)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < inter_size
    kk = tl.arange(0, BLOCK_K)
    gate_rows = w_ptr + expert * w_stride_e + n.to(tl.int64)[:, None] * w_stride_n
    up_rows = gate_rows + inter_size * w_stride_n
    gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = (k0 + kk) < hidden
        a = tl.load(x_ptr + token * x_stride + k0 + kk, mask=k_ok, other=0.0).to(tl.float32)
        mask = n_ok[:, None] & k_ok[None, :]
        wg = tl.load(gate_rows + (k0 + kk)[None, :], mask=mask, other=0.0)
        wu = tl.load(up_rows + (k0 + kk)[None, :], mask=mask, other=0.0)
        gate += wg.to(tl.float32) * a[None, :]
        up += wu.to(tl.float32) * a[None, :]
    g = tl.sum(gate, axis=1)
    u = tl.sum(up, axis=1)
    if HAS_BIAS:
        b_row = b_ptr + expert * 2 * inter_size
        g += tl.load(b_row + n, mask=n_ok, other=0.0).to(tl.float32)
        u += tl.load(b_row + inter_size + n, mask=n_ok, other=0.0).to(tl.float32)
    act = _expert_act(g, u, CLAMPED, alpha, limit)
    out = inter_ptr + pair.to(tl.int64) * inter_stride + n
    tl.store(out, act.to(inter_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _moe_gemv_down_kernel(
    inter_ptr, w_ptr, b_ptr, ids_ptr, weights_ptr, y_ptr, hidden, inter_size, inter_stride,
    w_stride_e, w_stride_n, y_stride, TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """Program (token t, block of BLOCK_N hidden columns): the sum over t's TOP_K pairs of the
    pair's expert's down rows times inter[pair] scaled by the pair's routing weight, in one fp32
    accumulator; writes y[t, cols] (no per-pair output, no separate sum). One loop over (pair,
    column block) steps whose addresses come from registers (the pairs' experts are loaded
    once, before it), so the pipeliner keeps several steps' weight tiles in flight."""
    wait_for_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < hidden
    kk = tl.arange(0, BLOCK_K)
    jj = tl.arange(0, BLOCK_P)
    ids = tl.load(ids_ptr + token * TOP_K + jj, mask=jj < TOP_K, other=0).to(tl.int64)
    wts = tl.load(weights_ptr + token * TOP_K + jj, mask=jj < TOP_K, other=0.0)
    rows = w_ptr + n.to(tl.int64)[:, None] * w_stride_n
    steps = tl.cdiv(inter_size, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for it in range(0, TOP_K * steps):
        j = it // steps
        k0 = (it - j * steps) * BLOCK_K
        expert = tl.sum(tl.where(jj == j, ids, 0), axis=0)
        weight = tl.sum(tl.where(jj == j, wts, 0.0), axis=0)
        k_ok = (k0 + kk) < inter_size
        a_row = inter_ptr + (token * TOP_K + j) * inter_stride
        a = tl.load(a_row + k0 + kk, mask=k_ok, other=0.0).to(tl.float32) * weight
        w = tl.load(
            rows + expert * w_stride_e + (k0 + kk)[None, :],
            mask=n_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        acc += w.to(tl.float32) * a[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:  # each pair's bias, scaled by its routing weight
        for j in tl.static_range(TOP_K):
            expert = tl.sum(tl.where(jj == j, ids, 0), axis=0)
            weight = tl.sum(tl.where(jj == j, wts, 0.0), axis=0)
            bias = tl.load(b_ptr + expert * hidden + n, mask=n_ok, other=0.0)
            y += bias.to(tl.float32) * weight
    tl.store(y_ptr + token * y_stride + n, y.to(y_ptr.dtype.element_ty), mask=n_ok)


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
    x, w13, w2, topk_weights, topk_ids, w13_bias=None, w2_bias=None, activation='silu',
    swiglu_alpha=1.702, swiglu_limit=7.0,
):  # fmt: skip
    """See `atom_kernels.ops.fused_moe`."""
    for name, t in (("x", x), ("w13", w13), ("w2", w2)):
        if t.stride(-1) != 1:
            raise ValueError(f"fused_moe needs {name} with a contiguous last dim")
    arith = ExpertArith(
        w13_bias, w2_bias, activation == "swiglu_clamped", swiglu_alpha, swiglu_limit
    )
    num_tokens, hidden = x.shape
    num_experts, inter = w13.shape[0], w2.shape[2]
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    if MOE_GEMV and num_tokens <= GEMV_MAX_TOKENS:
        return fused_moe_gemv(x, w13, w2, topk_weights, topk_ids, None, None, arith)
    # Few pairs per expert in decode: small row blocks waste less padding.
    block_m = 16 if num_pairs <= 64 * num_experts else 64
    sorted_pairs, block_expert = sort_pairs_by_expert(topk_ids, num_experts, block_m)
    num_blocks = block_expert.shape[0]
    ieee = x.dtype == torch.float32
    inter_buf = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    block_n, block_k = 64, 64
    _moe_gate_up_kernel[(num_blocks, triton.cdiv(inter, block_n))](
        x, w13, _or(arith.w13_bias, w13), inter_buf, sorted_pairs, block_expert, num_pairs,
        num_experts, hidden, inter, x.stride(0), w13.stride(0), w13.stride(1),
        inter_buf.stride(0), arith.alpha, arith.limit, TOP_K=top_k,
        HAS_BIAS=arith.w13_bias is not None, CLAMPED=arith.clamped, IEEE=ieee, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=4,
    )  # fmt: skip
    out_pairs = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).contiguous()
    _moe_down_kernel[(num_blocks, triton.cdiv(hidden, block_n))](
        inter_buf, w2, _or(arith.w2_bias, w2), out_pairs, weights, sorted_pairs, block_expert,
        num_pairs, num_experts, hidden, inter, inter_buf.stride(0), w2.stride(0), w2.stride(1),
        out_pairs.stride(0), HAS_BIAS=arith.w2_bias is not None, IEEE=ieee, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip
    return out_pairs.view(num_tokens, top_k, hidden).sum(1, dtype=torch.float32).to(x.dtype)


def _or(bias: torch.Tensor | None, placeholder: torch.Tensor) -> torch.Tensor:
    """A bias pointer for the launch: the bias, or any tensor when HAS_BIAS is off."""
    return placeholder if bias is None else bias


# Launch shapes of the pair GEMV: gate/up (BLOCK_N gate and as many up rows a program,
# BLOCK_K columns a step, warps) and down (BLOCK_N hidden rows, BLOCK_K columns, warps). A
# BLOCK_K as wide as the row loads a program's whole slice at once. On a GPU the first eager
# call for a shape times every candidate on random routings (`tune_gemv_launch`); the
# defaults serve CPU, the interpreter and a first call inside a graph capture.
GATE_UP_CANDIDATES = ((4, 2048, 4), (4, 2048, 8), (8, 1024, 8), (8, 256, 8), (2, 2048, 4))
DOWN_CANDIDATES = ((16, 512, 4), (8, 512, 4), (8, 512, 8), (32, 512, 8), (4, 512, 4))
DEFAULT_LAUNCH = ((8, 256, 8), (16, 256, 4))
_TUNED: dict[tuple, tuple[tuple[int, int, int], tuple[int, int, int]]] = {}


def fused_moe_gemv(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up: tuple[int, int, int] | None = None,
    down: tuple[int, int, int] | None = None,
    arith: ExpertArith = PLAIN,
) -> torch.Tensor:
    """`fused_moe` for a few tokens, pair by pair (no sort): a gate/up launch of one program per
    (pair, block of intermediate columns) streaming its expert's gate and up rows, then a down
    launch of one program per (token, block of hidden columns) summing the token's pairs in one
    fp32 accumulator. Arithmetic: fp32 sums, SwiGLU in fp32 rounded to the dtype, each pair's
    intermediate row scaled by its routing weight in fp32, the output rounded once.
    `gate_up` / `down`: launch shapes (BLOCK_N, BLOCK_K, warps); default the tuned ones.
    `arith`: biases and the clamped activation (GPT-OSS)."""
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    if num_tokens * top_k == 0:
        return torch.zeros_like(x)
    if gate_up is None or down is None:
        tuned = launch_shapes(x, w13, w2, top_k)
        gate_up, down = gate_up or tuned[0], down or tuned[1]
    ids = topk_ids.reshape(-1).contiguous()
    weights = topk_weights.reshape(-1).contiguous()
    inter = _gemv_gate_up(x, w13, ids, top_k, gate_up, arith)
    return _gemv_down(inter, w2, ids, weights, num_tokens, top_k, down, arith.w2_bias)


def _gemv_gate_up(x, w13, ids, top_k, shape, arith: ExpertArith = PLAIN) -> torch.Tensor:
    block_n, block_k, warps = shape
    num_pairs, hidden, inter = ids.shape[0], x.shape[1], w13.shape[1] // 2
    block_k = min(block_k, triton.next_power_of_2(hidden))
    out = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    _moe_gemv_gate_up_kernel[(num_pairs, triton.cdiv(inter, block_n))](
        x, w13, _or(arith.w13_bias, w13), ids, out, hidden, inter, x.stride(0), w13.stride(0),
        w13.stride(1), out.stride(0), arith.alpha, arith.limit, TOP_K=top_k,
        HAS_BIAS=arith.w13_bias is not None, CLAMPED=arith.clamped, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
        **pdl.options(x.device),
    )  # fmt: skip
    return out


def _gemv_down(inter, w2, ids, weights, num_tokens, top_k, shape, bias=None) -> torch.Tensor:
    block_n, block_k, warps = shape
    hidden, inter_size = w2.shape[1], w2.shape[2]
    block_k = min(block_k, triton.next_power_of_2(inter_size))
    y = torch.empty((num_tokens, hidden), dtype=inter.dtype, device=inter.device)
    _moe_gemv_down_kernel[(num_tokens, triton.cdiv(hidden, block_n))](
        inter, w2, _or(bias, w2), ids, weights, y, hidden, inter_size, inter.stride(0),
        w2.stride(0), w2.stride(1), y.stride(0), TOP_K=top_k, HAS_BIAS=bias is not None,
        BLOCK_P=triton.next_power_of_2(top_k),
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, **pdl.options(inter.device),
    )  # fmt: skip
    return y


def launch_shapes(x, w13, w2, top_k) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """The pair GEMV's (gate_up, down) launch shapes for these weights: timed once per shape on
    a GPU (not inside a graph capture, whose first call takes the defaults uncached)."""
    key = (tuple(w13.shape), tuple(w2.shape), top_k, x.dtype, x.device)
    if key in _TUNED:
        return _TUNED[key]
    if x.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return DEFAULT_LAUNCH
    _TUNED[key] = tune_gemv_launch(x, w13, w2, top_k)["best"]
    return _TUNED[key]


def tune_gemv_launch(x, w13, w2, top_k: int, routings: int = 32) -> dict:
    """Time each candidate launch shape of the two pair-GEMV kernels on one token routed to
    `routings` random expert sets (one CUDA graph each, so the weights stream from memory as in
    a decode step, not from L2). Returns {"gate_up": {shape: us}, "down": {...}, "best": ...}."""
    num_experts = w13.shape[0]
    gen = torch.Generator(device=x.device).manual_seed(0)
    sets = [
        torch.randperm(num_experts, generator=gen, device=x.device)[:top_k].to(torch.int32)
        for _ in range(routings)
    ]
    weights = torch.full((top_k,), 1.0 / top_k, dtype=torch.float32, device=x.device)
    row = x[:1]
    inters = [_gemv_gate_up(row, w13, ids, top_k, DEFAULT_LAUNCH[0]) for ids in sets]
    table: dict = {"gate_up": {}, "down": {}}
    for shape in GATE_UP_CANDIDATES:
        table["gate_up"][shape] = graph_call_us(
            lambda i, s=shape: _gemv_gate_up(row, w13, sets[i], top_k, s), routings
        )
    for shape in DOWN_CANDIDATES:
        table["down"][shape] = graph_call_us(
            lambda i, s=shape: _gemv_down(inters[i], w2, sets[i], weights, 1, top_k, s), routings
        )
    table["best"] = tuple(min(table[k], key=table[k].get) for k in ("gate_up", "down"))
    return table


def graph_call_us(fn, calls: int) -> float:
    """Microseconds a call of `fn(i)`, i < calls, captured in one CUDA graph (best of 3)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(calls):
            fn(i)  # compile and warm up outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for i in range(calls):
                fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / calls)
    return best


def moe_topk(router_logits, top_k, renormalize, shared_expert=False):
    """See `atom_kernels.ops.moe_topk`: one program per token (softmax, the top k by repeated
    max, the renormalization and the shared expert's sigmoid in one launch)."""
    num_tokens, width = router_logits.shape
    num_experts = width - 1 if shared_expert else width
    cols = top_k + 1 if shared_expert else top_k
    device = router_logits.device
    weights = torch.empty((num_tokens, cols), dtype=torch.float32, device=device)
    ids = torch.empty((num_tokens, cols), dtype=torch.int32, device=device)
    if num_tokens == 0:
        return weights, ids
    _moe_topk_kernel[(num_tokens,)](
        router_logits, weights, ids, num_experts, router_logits.stride(0), cols,
        TOP_K=top_k, RENORMALIZE=renormalize, SHARED=shared_expert,
        BLOCK_E=triton.next_power_of_2(num_experts), num_warps=4 if num_experts > 256 else 2,
        **pdl.options(device),
    )  # fmt: skip
    return weights, ids

"""Plain torch versions of every op in `atom_kernels.ops`.

These are the specification the Triton kernels are tested against, and also the CPU
path of the runtime, so they are vectorised per sequence (one Python iteration per
sequence, never per token) and compute in fp32 before casting back to the model dtype.

KV cache layout (per layer): `k_cache`, `v_cache` are
`[num_blocks, block_size, num_kv_heads, head_dim]`; a token's slot is
`block_id * block_size + offset`. An FP8 cache holds `clamp(k / k_scale)` (likewise v), read
back as `fp8 * k_scale`.
"""

from __future__ import annotations

import torch

from atom_kernels.fp8_formats import (
    MIN_AMAX,
    dequantize_fp8,
    dynamic_quant_max,
    is_fp8,
    quantize_weight_block,
    round_to_fp8,
    scale_layout,
)

# Upper bound on fp32 attention scores held at once by the prefill reference
# (elements, ~256 MiB): long prompts are processed in query chunks below this size.
_MAX_SCORE_ELEMENTS = 64 * 1024 * 1024


def store_kvcache(key, value, k_cache, v_cache, slot_mapping, *, k_scale=1.0, v_scale=1.0):
    """Write token `i`'s key/value into cache slot `slot_mapping[i]`; slot -1 is skipped."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = to_cache(key[keep], k_cache.dtype, k_scale)
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = to_cache(value[keep], v_cache.dtype, v_scale)


def to_cache(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | float) -> torch.Tensor:
    """x as a cache of `dtype` stores it: quantized with `scale` (fp32 division, clamped to the
    format's range, rounded to nearest even) for FP8, a cast otherwise."""
    if not is_fp8(dtype):
        return x.to(dtype)
    return round_to_fp8(x.float() / _scale_value(scale, x.device), dtype)


def from_cache(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """Cache contents as values: `fp8 * scale` in fp32 for an FP8 cache, x itself otherwise."""
    return x.float() * _scale_value(scale, x.device) if is_fp8(x) else x


def _scale_value(scale: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    if isinstance(scale, torch.Tensor):
        return scale.float().reshape(()).to(device)
    return torch.tensor(float(scale), dtype=torch.float32, device=device)


def gather_kv(
    cache: torch.Tensor, block_table_row: torch.Tensor, num_tokens: int, start: int = 0
) -> torch.Tensor:
    """Tokens `start..num_tokens` of one sequence as `[num_tokens - start, num_kv_heads,
    head_dim]`; blocks wholly before `start` are not read (a sliding window's freed blocks)."""
    block_size = cache.shape[1]
    first = start // block_size
    num_blocks = (num_tokens + block_size - 1) // block_size
    blocks = block_table_row[first:num_blocks].long()
    lo = start - first * block_size
    return cache[blocks].flatten(0, 1)[lo : num_tokens - first * block_size]


def window_start(first_query: int, sliding_window: int) -> int:
    """The first key position any query from `first_query` on sees under a sliding window of
    `sliding_window` keys (0: no window)."""
    return max(0, first_query - sliding_window + 1) if sliding_window > 0 else 0


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    first_position: int,
    sliding_window: int = 0,
    sinks: torch.Tensor | None = None,
    key_start: int = 0,
) -> torch.Tensor:
    """Attention of one sequence's queries over its keys, in fp32.

    q: `[q_len, num_heads, head_dim]`, query `i` at absolute position `first_position + i`;
    k: `[kv_len, num_kv_heads, head_dim]`, v: `[kv_len, num_kv_heads, v_dim]` (v_dim may differ
    from head_dim: latent attention), key `j` at position `key_start + j`. Query at position p
    sees keys `0..p`, or with a sliding window of W keys `p - W + 1..p`. sinks (`[num_heads]`):
    a per-head logit added to the softmax's denominator only (GPT-OSS). Returns fp32
    `[q_len, num_heads, v_dim]`.
    """
    q_len, num_heads, head_dim = q.shape
    kv_len, num_kv_heads, v_dim = k.shape[0], k.shape[1], v.shape[2]
    group = num_heads // num_kv_heads
    # Query heads sharing a KV head sit next to each other (head h uses KV head h // group).
    qf = q.float().reshape(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    kf = k.float().permute(1, 0, 2).unsqueeze(1)  # [kv_heads, 1, kv_len, head_dim]
    vf = v.float().permute(1, 0, 2).unsqueeze(1)
    key_pos = key_start + torch.arange(kv_len, device=q.device)
    sink = None
    if sinks is not None:  # [kv_heads, group, 1, 1], broadcast over the query rows
        sink = sinks.float().reshape(num_kv_heads, group, 1, 1)
    out = torch.empty(num_kv_heads, group, q_len, v_dim, dtype=torch.float32, device=q.device)
    rows_per_chunk = max(1, _MAX_SCORE_ELEMENTS // max(1, num_heads * kv_len))
    for lo in range(0, q_len, rows_per_chunk):
        hi = min(q_len, lo + rows_per_chunk)
        scores = torch.matmul(qf[:, :, lo:hi], kf.transpose(-1, -2)) * scale
        query_pos = first_position + torch.arange(lo, hi, device=q.device)
        hidden = key_pos[None, :] > query_pos[:, None]
        if sliding_window > 0:
            hidden |= key_pos[None, :] <= query_pos[:, None] - sliding_window
        scores.masked_fill_(hidden, float("-inf"))
        if sink is None:
            probs = torch.softmax(scores, dim=-1)
        else:
            with_sink = torch.cat([scores, sink.expand(-1, -1, hi - lo, 1)], dim=-1)
            probs = torch.softmax(with_sink, dim=-1)[..., :-1]
        out[:, :, lo:hi] = torch.matmul(probs, vf)
    return out.permute(2, 0, 1, 3).reshape(q_len, num_heads, v_dim)


def paged_attention_decode(
    q, k_cache, v_cache, block_tables, context_lens, scale, out=None, *, k_scale=1.0, v_scale=1.0,
    sliding_window=0, sinks=None,
):  # fmt: skip
    """One query token per sequence at position `context_lens[b] - 1`; zeros where length is 0.
    Only the window's blocks are read."""
    if out is None:
        out = torch.empty_like(q)
    for b, ctx in enumerate(context_lens.tolist()):
        if ctx <= 0:
            out[b].zero_()
            continue
        start = window_start(ctx - 1, sliding_window)
        k = from_cache(gather_kv(k_cache, block_tables[b], ctx, start), k_scale)
        v = from_cache(gather_kv(v_cache, block_tables[b], ctx, start), v_scale)
        att = causal_attention(q[b : b + 1], k, v, scale, ctx - 1, sliding_window, sinks, start)
        out[b] = att[0].to(out.dtype)
    return out


def paged_attention_prefill(
    q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, max_seqlen_q, out=None, *,
    k_scale=1.0, v_scale=1.0, sliding_window=0, sinks=None,
):  # fmt: skip
    """Causal attention of packed query chunks over their sequences' cached prefix + themselves
    (only the window's blocks read under a sliding window)."""
    if out is None:
        out = torch.empty_like(q)
    starts = cu_seqlens_q.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        lo, hi = starts[b], starts[b + 1]
        q_len = hi - lo
        if q_len == 0:
            continue
        if q_len > seq_len:
            raise ValueError(f"sequence {b}: {q_len} query tokens but seq_len {seq_len}")
        first = seq_len - q_len
        start = window_start(first, sliding_window)
        k = from_cache(gather_kv(k_cache, block_tables[b], seq_len, start), k_scale)
        v = from_cache(gather_kv(v_cache, block_tables[b], seq_len, start), v_scale)
        att = causal_attention(q[lo:hi], k, v, scale, first, sliding_window, sinks, start)
        out[lo:hi] = att.to(out.dtype)
    return out


def varlen_causal_attention(q, k, v, cu_seqlens_q, chunk_lens, scale, max_seqlen_q, padded_rows=0):
    """Causal attention of packed chunks, each over its own keys only (every chunk at position 0).
    `padded_rows` (rows past T the inputs' buffer holds) changes nothing here."""
    out = torch.empty_like(q)
    lo = 0
    for n in chunk_lens:
        hi = lo + n
        if n:
            out[lo:hi] = causal_attention(q[lo:hi], k[lo:hi], v[lo:hi], scale, 0).to(out.dtype)
        lo = hi
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x / sqrt(mean(x^2) + eps) * weight` over the last dim, in fp32; output in x.dtype."""
    xf = x.float()
    inv_rms = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * inv_rms * weight.float()).to(x.dtype)


def fused_add_rms_norm(x, residual, weight, eps):
    """`residual += x` (rounded to residual.dtype, in place); returns (rms_norm(residual), residual)."""
    residual.copy_(x.float() + residual.float())
    return rms_norm(residual, weight, eps), residual


def rotary_embedding_(positions, q, k, cos_sin_cache, is_neox=True):
    """Rotate the first `rotary_dim` channels of every head of q and k in place.

    cos_sin_cache: `[max_position, rotary_dim]`, cos in the first half, sin in the second.
    Neox style pairs channel `i` with `i + rotary_dim/2`; GPT-J style pairs `2i` with `2i+1`.
    """
    rotary_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions].float().chunk(2, dim=-1)  # [T, rotary_dim/2] each
    cos, sin = cos[:, None, :], sin[:, None, :]
    for x in (q, k):
        rot = x[..., :rotary_dim]
        if is_neox:
            x1, x2 = rot[..., : rotary_dim // 2].float(), rot[..., rotary_dim // 2 :].float()
            rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            x1, x2 = rot[..., 0::2].float(), rot[..., 1::2].float()
            rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        rot.copy_(rotated)


def qk_norm_rope_store_(
    qkv, positions, cos_sin_cache, q_norm_weight, k_norm_weight, eps, k_cache, v_cache,
    slot_mapping, num_heads, num_kv_heads, head_dim, q_gate=False, *, k_scale=1.0, v_scale=1.0,
):  # fmt: skip
    """The unfused path: per-head RMSNorm of q and k (when weights are given), neox rotary of
    the first rotary_dim channels of q and k in place inside `qkv`, then the k/v cache write.
    With `q_gate` each q head's gate follows it and is not touched."""
    t = qkv.shape[0]
    q_size, kv_size = (2 if q_gate else 1) * num_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_size].view(t, num_heads, q_size // num_heads)[..., :head_dim]
    k = qkv[:, q_size : q_size + kv_size].view(t, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size : q_size + 2 * kv_size].view(t, num_kv_heads, head_dim)
    if q_norm_weight is not None:
        q.copy_(rms_norm(q, q_norm_weight, eps))
        k.copy_(rms_norm(k, k_norm_weight, eps))
    rotary_embedding_(positions, q, k, cos_sin_cache, is_neox=True)
    store_kvcache(k, v, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)


def sigmoid_gate_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """`x * sigmoid(gate)` in fp32, a new contiguous tensor in x.dtype."""
    return (x.float() * torch.sigmoid(gate.float())).to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(x[:, :w]) * x[:, w:]` for `x` of width 2w, computed in fp32, returned in x.dtype."""
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def _linear(x, weight, bias, weight_scale, weight_block_size):
    """`F.linear`; with an FP8 weight, in fp32 with the dequantized weight, rounded to x's dtype
    (what the GEMV's fp32 sums give)."""
    if not is_fp8(weight):
        return torch.nn.functional.linear(x, weight, bias)
    w = dequantize_fp8(weight, weight_scale, weight_block_size)
    y = torch.nn.functional.linear(x.float(), w, None if bias is None else bias.float())
    return y.to(x.dtype)


def linear_small_m(x, weight, bias=None, *, act=None, weight_scale=None, weight_block_size=None):
    """`F.linear` (an FP8 weight dequantized, in fp32), then SwiGLU's activation when
    `act="silu_mul"`."""
    y = _linear(x, weight, bias, weight_scale, weight_block_size)
    return silu_and_mul(y) if act == "silu_mul" else y


def linear_few_rows(x, weight, bias=None, *, act=None):
    """`F.linear` of a few rows (a verify step's), then SwiGLU when `act="silu_mul"`."""
    return linear_small_m(x, weight, bias, act=act)


def linear_rope_store_small_m(
    x, weight, bias, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, num_heads,
    num_kv_heads, head_dim, q_norm_weight=None, k_norm_weight=None, eps=1e-06, *, weight_scale=None,
    weight_block_size=None, k_scale=1.0, v_scale=1.0,
):  # fmt: skip
    """`linear_small_m`, then `qk_norm_rope_store_` on the qkv row."""
    qkv = _linear(x, weight, bias, weight_scale, weight_block_size)
    qk_norm_rope_store_(
        qkv, positions, cos_sin_cache, q_norm_weight, k_norm_weight, eps, k_cache, v_cache,
        slot_mapping, num_heads, num_kv_heads, head_dim, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    return qkv


def rms_norm_linear_small_m(
    x, residual, norm_weight, eps, weight, bias=None, *, act=None, weight_scale=None,
    weight_block_size=None,
):  # fmt: skip
    """The norm (after the residual add, on a copy of the residual), then `linear_small_m`."""
    normed, total = _add_and_norm(x, residual, norm_weight, eps)
    y = linear_small_m(
        normed, weight, bias, act=act, weight_scale=weight_scale,
        weight_block_size=weight_block_size,
    )  # fmt: skip
    return y, total


def _add_and_norm(x, residual, norm_weight, eps):
    """(norm(x + residual), x + residual) with the residual left as it was, or (norm(x), x)."""
    if residual is None:
        return rms_norm(x, norm_weight, eps), x
    return fused_add_rms_norm(x, residual.clone(), norm_weight, eps)


def rms_norm_linear_rope_store_small_m(
    x, residual, norm_weight, eps, weight, bias, positions, cos_sin_cache, k_cache, v_cache,
    slot_mapping, num_heads, num_kv_heads, head_dim, q_norm_weight=None, k_norm_weight=None,
    qk_eps=1e-06, *, weight_scale=None, weight_block_size=None, k_scale=1.0, v_scale=1.0,
):  # fmt: skip
    """The norm (after the residual add, on a copy of the residual), then
    `linear_rope_store_small_m`."""
    normed, total = _add_and_norm(x, residual, norm_weight, eps)
    qkv = linear_rope_store_small_m(
        normed, weight, bias, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
        num_heads, num_kv_heads, head_dim, q_norm_weight, k_norm_weight, qk_eps,
        weight_scale=weight_scale, weight_block_size=weight_block_size, k_scale=k_scale,
        v_scale=v_scale,
    )  # fmt: skip
    return qkv, total


# ---------------------------------------------------------------------------------------------
# FP8 activation quantizers and the W8A8 linear: scales are dequantization multipliers.
# ---------------------------------------------------------------------------------------------


def per_tensor_quant_fp8(x, fp8_dtype, scale=None):
    """One scale for all of x: the given one, or amax / `dynamic_quant_max`."""
    if scale is None:
        amax = x.abs().amax().float() if x.numel() else x.new_zeros((), dtype=torch.float32)
        scale = amax.clamp(min=MIN_AMAX) / dynamic_quant_max(fp8_dtype)
    scale = scale.float().reshape(1)
    return round_to_fp8(x.float() / scale, fp8_dtype), scale


def per_token_quant_fp8(x, fp8_dtype):
    """Each row by its own amax / `dynamic_quant_max`; scale `[M, 1]`."""
    return per_token_group_quant_fp8(x, max(1, x.shape[1]), fp8_dtype)


def per_token_group_quant_fp8(x, group_size, fp8_dtype):
    """Each run of `group_size` columns of a row by its own amax / `dynamic_quant_max`;
    scale `[M, ceil(K / group_size)]`: the block quantizer's math with blocks of 1 x g."""
    return quantize_weight_block(x, (1, group_size), fp8_dtype)


def fp8_linear(x, weight, weight_scale, bias=None, *, input_scale=None, weight_block_size=None):
    """W8A8: x quantized as the GPU path quantizes it (per token group for block weights, else
    per token or with the static input_scale), both operands dequantized, the product in fp32,
    plus bias, in x's dtype."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    fp8 = weight.dtype
    if scale_layout(weight.shape, weight_scale, weight_block_size) == "block":
        group = weight_block_size[1]
        aq, a_s = per_token_group_quant_fp8(x2, group, fp8)
        a = dequantize_fp8(aq, a_s, (1, group))
    else:
        if input_scale is not None:
            aq, a_s = per_tensor_quant_fp8(x2, fp8, input_scale)
        else:
            aq, a_s = per_token_quant_fp8(x2, fp8)
        a = dequantize_fp8(aq, a_s)
    w = dequantize_fp8(weight, weight_scale, weight_block_size)
    y = a @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


# ---------------------------------------------------------------------------------------------
# Hybrid (linear-attention) models: Gated DeltaNet, its causal conv1d, gated RMSNorm, MoE.
# Sequences are packed back to back: `query_start_loc` int32 [B+1]; `slot_ids` int32 [B] names
# each sequence's row of a state pool (-1: a padding row, nothing read or written, zero output);
# `has_initial_state` bool [B] (False: start from zeros whatever the slot holds).
# ---------------------------------------------------------------------------------------------

GDN_CHUNK = 64


def _rows(query_start_loc, slot_ids, has_initial_state):
    """(start, end, slot, resume) per sequence, read to the host once."""
    starts = query_start_loc.tolist()
    return [
        (starts[b], starts[b + 1], slot, resume)
        for b, (slot, resume) in enumerate(
            zip(slot_ids.tolist(), has_initial_state.tolist(), strict=True)
        )
    ]


def causal_conv1d_(
    x, weight, bias, conv_state, query_start_loc, slot_ids, has_initial_state, activation='silu',
):  # fmt: skip
    """Depthwise causal conv over `[state ; x]` per sequence; the slot keeps the last W-1 inputs."""
    width = weight.shape[1]
    y = torch.zeros_like(x)
    wf = weight.float()  # [D, W]
    for start, end, slot, resume in _rows(query_start_loc, slot_ids, has_initial_state):
        if slot < 0 or end == start:
            continue  # a padding row, or a row with no tokens: nothing read or written
        if resume:
            history = conv_state[slot].float().t()  # [W-1, D], oldest first
        else:
            history = x.new_zeros(width - 1, x.shape[1], dtype=torch.float32)
        full = torch.cat([history, x[start:end].float()])  # [W-1+L, D]
        windows = full.unfold(0, width, 1)  # [L, D, W]: window t ends at token t
        out = (windows * wf).sum(-1)
        if bias is not None:
            out = out + bias.float()
        if activation == "silu":
            out = torch.nn.functional.silu(out)
        y[start:end] = out.to(y.dtype)
        conv_state[slot] = full[full.shape[0] - (width - 1) :].t().to(conv_state.dtype)
    return y


def causal_conv1d_verify_(
    x, weight, bias, conv_state, query_start_loc, slots, has_initial_state, activation='silu',
):  # fmt: skip
    """`causal_conv1d_` reading sequence b's window from slot `slots[b, 0]` and writing the
    window after each of its tokens j to slot `slots[b, j]` (when j < W and it is >= 0)."""
    width = weight.shape[1]
    y = torch.zeros_like(x)
    wf = weight.float()
    starts, rows = query_start_loc.tolist(), slots.tolist()
    for b, (row, resume) in enumerate(zip(rows, has_initial_state.tolist(), strict=True)):
        start, end = starts[b], starts[b + 1]
        if row[0] < 0 or end == start:
            continue  # not a verified row: nothing read or written
        if resume:
            history = conv_state[row[0]].float().t()  # [W-1, D], oldest first
        else:
            history = x.new_zeros(width - 1, x.shape[1], dtype=torch.float32)
        full = torch.cat([history, x[start:end].float()])  # a copy: read before any write
        out = (full.unfold(0, width, 1) * wf).sum(-1)
        if bias is not None:
            out = out + bias.float()
        if activation == "silu":
            out = torch.nn.functional.silu(out)
        y[start:end] = out.to(y.dtype)
        for j in range(min(end - start, len(row))):
            if row[j] >= 0:
                conv_state[row[j]] = full[j + 1 : j + width].t().to(conv_state.dtype)
    return y


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`x / sqrt(sum(x^2) + eps)` over the last dim (fla's and transformers' l2norm)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _gdn_inputs(q, k, v, g, beta, scale, use_qk_l2norm):
    """fp32, k heads repeated to the v heads, heads first: q, k [Hv, L, Dk], v [Hv, L, Dv],
    g, beta [Hv, L]; q and k normalised, q scaled."""
    group = v.shape[1] // k.shape[1]
    q = q.float().repeat_interleave(group, dim=1).transpose(0, 1)
    k = k.float().repeat_interleave(group, dim=1).transpose(0, 1)
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    q = q * scale
    return q, k, v.float().transpose(0, 1), g.float().t(), beta.float().t()


def gdn_recurrent_step(q, k, v, g, beta, state):
    """One token of the gated delta rule for a batch of heads, in fp32.

    q, k [N, Dk] (normalised and scaled), v [N, Dv], g, beta [N], state [N, Dk, Dv].
    Returns (o [N, Dv], new state)."""
    state = state * g.exp()[:, None, None]
    predicted = torch.einsum("nk,nkv->nv", k, state)
    delta = beta[:, None] * (v - predicted)
    state = state + k[:, :, None] * delta[:, None, :]
    return torch.einsum("nk,nkv->nv", q, state), state


def gdn_chunked(q, k, v, g, beta, state, chunk: int = GDN_CHUNK):
    """The gated delta rule over one sequence, `chunk` tokens at a time, in fp32.

    q, k [H, L, Dk] (normalised, q scaled), v [H, L, Dv], g, beta [H, L], state [H, Dk, Dv].
    Within a chunk the L sequential rank-1 updates are folded into one triangular solve (the
    WY form of a product of Householder-like factors), so the work is matmuls; the state
    crosses chunk borders exactly as the token recurrence would carry it.
    Returns (o [H, L, Dv], final state)."""
    heads, length, dk = k.shape
    pad = (-length) % chunk
    if pad:
        # Padded tokens have beta 0 (no write), k 0 and g 0 (no decay): the state passes through.
        q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (torch.nn.functional.pad(t, (0, pad)) for t in (g, beta))
    n = (length + pad) // chunk
    q, k, v = (t.reshape(heads, n, chunk, t.shape[-1]) for t in (q, k, v))
    g, beta = g.reshape(heads, n, chunk), beta.reshape(heads, n, chunk)
    gc = g.cumsum(-1)  # log decay from the chunk start up to and including token i
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # decay[i, j] = exp(gc_i - gc_j) for j <= i: what token j's write has decayed by at i.
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    kb = k * beta[..., None]
    # Token i's write is beta_i (v_i - k_i S_{i-1}); unrolling S_{i-1} inside the chunk gives a
    # unit lower-triangular system in the writes: (I + tril(kb k^T * decay, -1)) U = rhs.
    system = (kb @ k.transpose(-1, -2)) * decay
    system = system.masked_fill(~causal.tril(-1), 0.0) + torch.eye(chunk, device=q.device)
    writes_v = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False)
    writes_s = torch.linalg.solve_triangular(system, kb * gc.exp()[..., None], upper=False)
    attn = (q @ k.transpose(-1, -2)) * decay  # intra-chunk scores, causal incl. the diagonal
    q_decayed = q * gc.exp()[..., None]
    k_to_end = k * (gc[..., -1:] - gc).exp()[..., None]
    chunk_decay = gc[..., -1].exp()
    out = torch.empty_like(v)
    for c in range(n):
        u = writes_v[:, c] - writes_s[:, c] @ state  # the chunk's writes given the entry state
        out[:, c] = q_decayed[:, c] @ state + attn[:, c] @ u
        state = state * chunk_decay[:, c, None, None] + k_to_end[:, c].transpose(-1, -2) @ u
    return out.reshape(heads, n * chunk, v.shape[-1])[:, :length], state


def gated_delta_rule_(
    q, k, v, g, beta, state, query_start_loc, slot_ids, has_initial_state, scale,
    use_qk_l2norm=True,
):  # fmt: skip
    """Gated DeltaNet over packed sequences: every 1-token row advances in one batched
    recurrent step, longer rows run chunked; each slot's state is updated in place."""
    o = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    rows = [r for r in _rows(query_start_loc, slot_ids, has_initial_state) if r[2] >= 0]
    steps = [r for r in rows if r[1] - r[0] == 1]
    if steps:
        tokens = torch.tensor([r[0] for r in steps], device=v.device)
        slots = torch.tensor([r[2] for r in steps], device=v.device)
        resume = torch.tensor([r[3] for r in steps], device=v.device)
        qs, ks, vs, gs, bs = _gdn_inputs(
            q[tokens], k[tokens], v[tokens], g[tokens], beta[tokens], scale, use_qk_l2norm
        )  # heads first: [Hv, B, ...]
        s0 = state[slots].float() * resume[:, None, None, None]  # [B, Hv, Dk, Dv]
        hv = v.shape[1]
        out, s1 = gdn_recurrent_step(
            qs.transpose(0, 1).flatten(0, 1),
            ks.transpose(0, 1).flatten(0, 1),
            vs.transpose(0, 1).flatten(0, 1),
            gs.t().flatten(),
            bs.t().flatten(),
            s0.flatten(0, 1),
        )
        o[tokens] = out.view(len(steps), hv, -1).to(o.dtype)
        state[slots] = s1.view(s0.shape).to(state.dtype)
    for start, end, slot, resume in rows:
        if end - start <= 1:
            continue  # one token: done above; none: the state is left as it is
        qs, ks, vs, gs, bs = _gdn_inputs(
            q[start:end], k[start:end], v[start:end], g[start:end], beta[start:end], scale,
            use_qk_l2norm,
        )  # fmt: skip
        if resume:
            s0 = state[slot].float()
        else:
            s0 = torch.zeros(state.shape[1:], dtype=torch.float32, device=state.device)
        out, s1 = gdn_chunked(qs, ks, vs, gs, bs, s0)
        o[start:end] = out.transpose(0, 1).to(o.dtype)
        state[slot] = s1.to(state.dtype)
    return o


def gated_delta_rule_verify_(
    q, k, v, g, beta, state, query_start_loc, slots, has_initial_state, scale, use_qk_l2norm=True,
):  # fmt: skip
    """The gated delta rule token by token, sequence b starting from slot `slots[b, 0]` and
    leaving the state after each of its tokens j in slot `slots[b, j]` (when j < W, >= 0);
    between tokens the state is rounded to the state's dtype, so each token sees what one-token
    decode steps would."""
    o = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    starts, rows = query_start_loc.tolist(), slots.tolist()
    for b, (row, resume) in enumerate(zip(rows, has_initial_state.tolist(), strict=True)):
        start, end = starts[b], starts[b + 1]
        if row[0] < 0 or end == start:
            continue
        qs, ks, vs, gs, bs = _gdn_inputs(
            q[start:end], k[start:end], v[start:end], g[start:end], beta[start:end], scale,
            use_qk_l2norm,
        )  # fmt: skip
        if resume:
            s = state[row[0]].float().clone()
        else:
            s = torch.zeros(state.shape[1:], dtype=torch.float32, device=state.device)
        for j in range(end - start):
            out, s = gdn_recurrent_step(qs[:, j], ks[:, j], vs[:, j], gs[:, j], bs[:, j], s)
            o[start + j] = out.to(o.dtype)
            if j < len(row) and row[j] >= 0:
                state[row[j]] = s.to(state.dtype)
            # The next token starts from the state as stored (bf16 with
            # --mamba-ssm-cache-dtype bfloat16), as a plain decode step after this one would.
            s = s.to(state.dtype).float()
    return o


def gated_rms_norm(x, z, weight, eps):
    """`rms_norm(x) * weight * silu(z)` over the last dim, in fp32; output in x.dtype."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (normed * torch.nn.functional.silu(z.float())).to(x.dtype)


def gdn_gating(a, b, a_log, dt_bias):
    """`(-exp(a_log) * softplus(a + dt_bias), sigmoid(b))`, both fp32 `[T, Hv]`."""
    g = -a_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b.float())


def gated_delta_net_decode_(
    proj, conv_weight, conv_state, ssm_state, a_log, dt_bias, norm_weight, eps, slot_ids,
    has_initial_state, scale,
):  # fmt: skip
    """One token per row through conv + silu, the gates, the L2-normed delta rule step and the
    gated norm, batched over the real rows; both states updated in place at their slots."""
    hv, dk, dv = ssm_state.shape[1:]
    conv_dim = conv_weight.shape[0]
    key_size = (conv_dim - hv * dv) // 2
    out = torch.zeros(proj.shape[0], hv * dv, dtype=proj.dtype, device=proj.device)
    rows = torch.nonzero(slot_ids >= 0).squeeze(1)
    if rows.numel() == 0:
        return out
    n, slots = rows.numel(), slot_ids[rows].long()
    resume = has_initial_state[rows]
    x = proj[rows]
    # Conv over [window (or zeros) ; token]; the slot keeps the window's last W-1 inputs.
    window = torch.where(resume[:, None, None], conv_state[slots].float(), 0.0)
    full = torch.cat([window, x[:, :conv_dim, None].float()], dim=-1)  # [n, conv_dim, W]
    mixed = torch.nn.functional.silu((full * conv_weight.float()).sum(-1)).to(proj.dtype)
    conv_state[slots] = full[..., 1:].to(conv_state.dtype)
    q = mixed[:, :key_size].view(n, -1, dk)
    k = mixed[:, key_size : 2 * key_size].view(n, -1, dk)
    v = mixed[:, 2 * key_size :].view(n, hv, dv)
    z = x[:, conv_dim : conv_dim + hv * dv]
    g, beta = gdn_gating(x[:, -hv:], x[:, -2 * hv : -hv], a_log, dt_bias)
    qs, ks, vs, gs, bs = _gdn_inputs(q, k, v, g, beta, scale, use_qk_l2norm=True)  # [Hv, n, .]
    s0 = torch.where(resume[:, None, None, None], ssm_state[slots].float(), 0.0)
    o, s1 = gdn_recurrent_step(
        qs.transpose(0, 1).flatten(0, 1), ks.transpose(0, 1).flatten(0, 1),
        vs.transpose(0, 1).flatten(0, 1), gs.t().flatten(), bs.t().flatten(), s0.flatten(0, 1),
    )  # fmt: skip
    ssm_state[slots] = s1.view(s0.shape).to(ssm_state.dtype)
    o = o.to(proj.dtype)  # [n * Hv, Dv], what the recurrence kernel would hand the norm
    out[rows] = gated_rms_norm(o, z.reshape(n * hv, dv), norm_weight, eps).view(n, hv * dv)
    return out


def moe_topk(router_logits, top_k, renormalize, shared_expert=False):
    """Softmax over the experts in fp32, the top_k of it (optionally rescaled to sum 1); with
    shared_expert, a last column for expert E weighted by the sigmoid of the last logit."""
    logits = router_logits.float()
    routed = logits[:, :-1] if shared_expert else logits
    probs = torch.softmax(routed, dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    ids = ids.to(torch.int32)
    if shared_expert:
        weights = torch.cat([weights, torch.sigmoid(logits[:, -1:])], dim=1)
        ids = torch.cat([ids, torch.full_like(ids[:, :1], routed.shape[1])], dim=1)
    return weights, ids


def fused_moe(
    x, w13, w2, topk_weights, topk_ids, w13_bias=None, w2_bias=None, activation='silu',
    swiglu_alpha=1.702, swiglu_limit=7.0,
):  # fmt: skip
    """Sparse MoE with gated experts, in fp32: one pass per expert that has tokens."""
    inter = w2.shape[2]
    top_k = topk_ids.shape[1]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    flat = topk_ids.flatten().long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    lo = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[lo : lo + count]
        lo += count
        tokens = pairs // top_k
        h = x[tokens].float() @ w13[expert].float().t()  # [n, 2I]
        if w13_bias is not None:
            h = h + w13_bias[expert].float()
        act = expert_activation(h[:, :inter], h[:, inter:], activation, swiglu_alpha, swiglu_limit)
        y = act @ w2[expert].float().t()
        if w2_bias is not None:
            y = y + w2_bias[expert].float()
        out.index_add_(0, tokens, y * topk_weights.flatten()[pairs, None].float())
    return out.to(x.dtype)


def expert_activation(
    gate: torch.Tensor, up: torch.Tensor, activation: str, alpha: float, limit: float
) -> torch.Tensor:
    """An expert's gated activation (see `ops.fused_moe`)."""
    if activation == "silu":
        return torch.nn.functional.silu(gate) * up
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return gate * torch.sigmoid(gate * alpha) * (up + 1)


def state_copy_(pools, table, unit_bytes, max_units):
    """Copy every unit of the affine unit table (see `atom_kernels.copy_table`), run by run,
    the units counted past `max_units` left out (as the kernel's launch leaves them)."""
    left = max_units
    span = torch.arange(unit_bytes, device=table.device)
    for spool, soff, sstride, dpool, doff, dstride, count in table.tolist():
        count = min(count, left)
        left -= count
        if count <= 0:
            continue
        i = torch.arange(count, device=table.device)[:, None]
        src = (soff + i * sstride + span).flatten().to(pools[spool].device)
        dst = (doff + i * dstride + span).flatten().to(pools[dpool].device)
        pools[dpool][dst] = pools[spool][src]


# ---------------------------------------------------------------------------------------------
# Multi-head latent attention (DeepSeek-V2/V3): one latent cache row per token, not per head.
# ---------------------------------------------------------------------------------------------


def mla_rope_store_(
    q_rope, kv_a, positions, cos_sin_cache, kv_norm_weight, eps, kv_cache, slot_mapping,
    is_neox=False,
):  # fmt: skip
    """Rotate q_rope in place; store [rms_norm(latent) | rotated rope key] at each slot >= 0."""
    rope = q_rope.shape[2]
    latent = kv_cache.shape[2] - rope
    normed = rms_norm(kv_a[:, :latent], kv_norm_weight, eps)
    k_rope = kv_a[:, latent:].unsqueeze(1).clone()
    rotary_embedding_(positions, q_rope, k_rope, cos_sin_cache, is_neox)
    keep = slot_mapping >= 0
    rows = torch.cat([normed.float(), k_rope[:, 0].float()], dim=-1)[keep]
    kv_cache.view(-1, kv_cache.shape[2])[slot_mapping[keep]] = rows.to(kv_cache.dtype)


def mla_decode_attention(q_latent, q_rope, kv_cache, block_tables, context_lens, scale, out=None):
    """Row b's heads attend over the first context_lens[b] cache rows of its block table, the
    row's latent part as the value; zeros where the length is 0. Rows are processed in groups
    (vectorised, gathered up to the group's longest context) small enough to bound memory."""
    rows, heads, latent = q_latent.shape
    if out is None:
        out = torch.empty(rows, heads, latent, dtype=q_latent.dtype, device=q_latent.device)
    block_size, width = kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(-1, width)
    lens = context_lens.tolist()
    q = torch.cat([q_latent.float(), q_rope.float()], dim=-1)  # [B, H, latent + rope]
    step = max(1, _MAX_SCORE_ELEMENTS // max(1, (heads + width) * max(lens, default=1)))
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        n = max(lens[lo:hi])
        if n <= 0:
            out[lo:hi].zero_()
            continue
        pos = torch.arange(n, device=flat.device)
        blocks = block_tables[lo:hi, (pos // block_size)].long()
        slots = (blocks * block_size + pos % block_size).clamp(min=0)
        valid = pos[None, :] < context_lens[lo:hi, None].to(pos.device)
        kv = torch.where(valid[..., None], flat[slots].float(), 0.0)  # [g, n, width]
        scores = torch.einsum("ghd,gnd->ghn", q[lo:hi], kv) * scale
        scores.masked_fill_(~valid[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a 0-length row: all -inf
        out[lo:hi] = torch.einsum("ghn,gnl->ghl", probs, kv[..., :latent]).to(out.dtype)
    return out


def mla_prefill_attention(q, k, v, q_lens, kv_lens, scale):
    """Causal attention of packed chunks over their own packed keys, bottom-right aligned."""
    out = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype, device=q.device)
    q_at = kv_at = 0
    for q_len, kv_len in zip(q_lens, kv_lens, strict=True):
        if q_len:
            keys = slice(kv_at, kv_at + kv_len)
            o = causal_attention(q[q_at : q_at + q_len], k[keys], v[keys], scale, kv_len - q_len)
            out[q_at : q_at + q_len] = o.to(out.dtype)
        q_at += q_len
        kv_at += kv_len
    return out

"""Plain torch versions of every op in `atom_kernels.ops`.

These are the specification the Triton kernels are tested against, and also the CPU
path of the runtime, so they are vectorised per sequence (one Python iteration per
sequence, never per token) and compute in fp32 before casting back to the model dtype.

KV cache layout (per layer): `k_cache`, `v_cache` are
`[num_blocks, block_size, num_kv_heads, head_dim]`; a token's slot is
`block_id * block_size + offset`.
"""

from __future__ import annotations

import torch

# Upper bound on fp32 attention scores held at once by the prefill reference
# (elements, ~256 MiB): long prompts are processed in query chunks below this size.
_MAX_SCORE_ELEMENTS = 64 * 1024 * 1024


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write token `i`'s key/value into cache slot `slot_mapping[i]`; slot -1 is skipped."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = key[keep].to(k_cache.dtype)
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = value[keep].to(v_cache.dtype)


def gather_kv(cache: torch.Tensor, block_table_row: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The first `num_tokens` tokens of one sequence as `[num_tokens, num_kv_heads, head_dim]`."""
    block_size = cache.shape[1]
    num_blocks = (num_tokens + block_size - 1) // block_size
    blocks = block_table_row[:num_blocks].long()
    return cache[blocks].flatten(0, 1)[:num_tokens]


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, first_position: int
) -> torch.Tensor:
    """Attention of one sequence's queries over its keys, in fp32.

    q: `[q_len, num_heads, head_dim]`, query `i` at absolute position `first_position + i`;
    k, v: `[kv_len, num_kv_heads, head_dim]`, key `j` at position `j`. Query `i` sees keys
    `0..first_position + i`. Returns fp32 `[q_len, num_heads, head_dim]`.
    """
    q_len, num_heads, head_dim = q.shape
    kv_len, num_kv_heads = k.shape[0], k.shape[1]
    group = num_heads // num_kv_heads
    # Query heads sharing a KV head sit next to each other (head h uses KV head h // group).
    qf = q.float().reshape(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    kf = k.float().permute(1, 0, 2).unsqueeze(1)  # [kv_heads, 1, kv_len, head_dim]
    vf = v.float().permute(1, 0, 2).unsqueeze(1)
    key_pos = torch.arange(kv_len, device=q.device)
    out = torch.empty(num_kv_heads, group, q_len, head_dim, dtype=torch.float32, device=q.device)
    rows_per_chunk = max(1, _MAX_SCORE_ELEMENTS // max(1, num_heads * kv_len))
    for lo in range(0, q_len, rows_per_chunk):
        hi = min(q_len, lo + rows_per_chunk)
        scores = torch.matmul(qf[:, :, lo:hi], kf.transpose(-1, -2)) * scale
        query_pos = first_position + torch.arange(lo, hi, device=q.device)
        future = key_pos[None, :] > query_pos[:, None]
        scores.masked_fill_(future, float("-inf"))
        out[:, :, lo:hi] = torch.matmul(torch.softmax(scores, dim=-1), vf)
    return out.permute(2, 0, 1, 3).reshape(q_len, num_heads, head_dim)


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence at position `context_lens[b] - 1`; zeros where length is 0."""
    if out is None:
        out = torch.empty_like(q)
    for b, ctx in enumerate(context_lens.tolist()):
        if ctx <= 0:
            out[b].zero_()
            continue
        k = gather_kv(k_cache, block_tables[b], ctx)
        v = gather_kv(v_cache, block_tables[b], ctx)
        out[b] = causal_attention(q[b : b + 1], k, v, scale, ctx - 1)[0].to(out.dtype)
    return out


def paged_attention_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_seqlen_q: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed query chunks over their sequences' cached prefix + themselves."""
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
        k = gather_kv(k_cache, block_tables[b], seq_len)
        v = gather_kv(v_cache, block_tables[b], seq_len)
        out[lo:hi] = causal_attention(q[lo:hi], k, v, scale, seq_len - q_len).to(out.dtype)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x / sqrt(mean(x^2) + eps) * weight` over the last dim, in fp32; output in x.dtype."""
    xf = x.float()
    inv_rms = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * inv_rms * weight.float()).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`residual += x` (rounded to residual.dtype, in place); returns (rms_norm(residual), residual)."""
    residual.copy_(x.float() + residual.float())
    return rms_norm(residual, weight, eps), residual


def rotary_embedding_(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> None:
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
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> None:
    """The unfused path: per-head RMSNorm of q and k (when weights are given), neox rotary of q
    and k in place inside `qkv`, then the k/v cache write."""
    t = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_size].view(t, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(t, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size : q_size + 2 * kv_size].view(t, num_kv_heads, head_dim)
    if q_norm_weight is not None:
        q.copy_(rms_norm(q, q_norm_weight, eps))
        k.copy_(rms_norm(k, k_norm_weight, eps))
    rotary_embedding_(positions, q, k, cos_sin_cache, is_neox=True)
    store_kvcache(k, v, k_cache, v_cache, slot_mapping)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(x[:, :w]) * x[:, w:]` for `x` of width 2w, computed in fp32, returned in x.dtype."""
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)

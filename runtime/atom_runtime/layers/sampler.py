"""The sampler: penalties, logit bias, allowed tokens, temperature, top-k, top-p and min-p, then a draw — all torch ops on the
logits' device, so a GPU step needs no host round trip until the sampled ids are read back.

Unseeded rows draw with the exponential-race trick (argmax of p / q, q ~ Exp(1)) in one batched op;
seeded rows draw from their request's own generator so a seed gives the same tokens in any batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingTensors:
    """Per-row parameters of one step, on the logits' device."""

    temperature: torch.Tensor  # [S] fp32; rows with 0 are greedy
    top_k: torch.Tensor  # [S] int64; 0 = off
    top_p: torch.Tensor  # [S] fp32; 1 = off
    min_p: torch.Tensor  # [S] fp32; 0 = off
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    # Penalties (None when no row uses them): token counts of the output so far and prompt mask.
    output_counts: torch.Tensor | None = None  # [S, V] fp32
    prompt_mask: torch.Tensor | None = None  # [S, V] bool
    presence: torch.Tensor | None = None
    frequency: torch.Tensor | None = None
    repetition: torch.Tensor | None = None
    # Logit bias: (rows, token ids, biases), added after the penalties.
    bias_rows: torch.Tensor | None = None
    bias_tokens: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    # Rows restricted to allowed token ids: the rows, and (index into those rows, token id).
    allowed_rows: torch.Tensor | None = None
    allowed_index: torch.Tensor | None = None
    allowed_tokens: torch.Tensor | None = None
    # Guided rows (structured outputs) and their grammars' bitmasks, [R, ceil(V / 32)] int32:
    # bit t of a row's mask set when its grammar allows token t next.
    guided_rows: torch.Tensor | None = None
    guided_bitmask: torch.Tensor | None = None
    # Tokens banned this step per row (EOS and stop ids before min_tokens): (rows, token ids).
    banned_rows: torch.Tensor | None = None
    banned_tokens: torch.Tensor | None = None
    generators: dict[int, torch.Generator] | None = None  # row -> seeded generator
    max_logprobs: int = -1  # -1: no logprobs wanted in this batch


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [S] int64
    logprobs: torch.Tensor | None = None  # [S] the sampled token's logprob
    top_ids: torch.Tensor | None = None  # [S, k]
    top_logprobs: torch.Tensor | None = None  # [S, k]


def apply_penalties(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    if t.output_counts is None:
        return logits
    seen = (t.output_counts > 0) | t.prompt_mask
    rep = t.repetition.unsqueeze(1)
    logits = torch.where(seen & (logits > 0), logits / rep, logits)
    logits = torch.where(seen & (logits <= 0), logits * rep, logits)
    logits = logits - t.frequency.unsqueeze(1) * t.output_counts
    logits = logits - t.presence.unsqueeze(1) * (t.output_counts > 0).to(logits.dtype)
    return logits


def apply_bias_and_allowed(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Add each row's logit bias, then mask (to -inf) every token outside a row's allowed set
    and every token a guided row's grammar cannot take next."""
    if t.bias_rows is not None:
        logits = logits.index_put((t.bias_rows, t.bias_tokens), t.bias_values, accumulate=True)
    if t.allowed_rows is not None:
        keep = torch.zeros(
            (t.allowed_rows.shape[0], logits.shape[1]), dtype=torch.bool, device=logits.device
        )
        keep[t.allowed_index, t.allowed_tokens] = True
        restricted = logits[t.allowed_rows].masked_fill(~keep, float("-inf"))
        logits = logits.index_copy(0, t.allowed_rows, restricted)
    if t.guided_rows is not None:
        vocab = logits.shape[1]
        bits = torch.arange(32, dtype=torch.int32, device=logits.device)
        allowed = ((t.guided_bitmask.unsqueeze(-1) >> bits) & 1).flatten(1)[:, :vocab]
        guided = logits[t.guided_rows].masked_fill(allowed == 0, float("-inf"))
        logits = logits.index_copy(0, t.guided_rows, guided)
    return logits


def apply_top_k_top_p_min_p(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Mask (to -inf) every token outside each row's top-k, nucleus top-p and min-p sets."""
    if t.any_min_p:
        probs = logits.softmax(dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * t.min_p.unsqueeze(1)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if not (t.any_top_k or t.any_top_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    if t.any_top_k:
        k = torch.where(t.top_k > 0, t.top_k, vocab).clamp(max=vocab)
        kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if t.any_top_p:
        probs = sorted_logits.softmax(dim=-1)
        # Keep a token while the mass before it is below top_p (the top token always stays).
        mass_before = probs.cumsum(dim=-1) - probs
        sorted_logits = sorted_logits.masked_fill(
            mass_before >= t.top_p.unsqueeze(1), float("-inf")
        )
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def sample(logits: torch.Tensor, t: SamplingTensors) -> SamplerOutput:
    """logits: [S, V] fp32 (one row per sequence that samples this step)."""
    raw_logprobs = logits.log_softmax(dim=-1) if t.max_logprobs >= 0 else None
    logits = apply_bias_and_allowed(apply_penalties(logits, t), t)
    if t.banned_rows is not None:
        logits = logits.index_put((t.banned_rows, t.banned_tokens), torch.tensor(float("-inf")))
    greedy = logits.argmax(dim=-1)
    if t.all_greedy:
        token_ids = greedy
    else:
        temp = torch.where(t.temperature > 0, t.temperature, 1.0).unsqueeze(1)
        scaled = apply_top_k_top_p_min_p(logits / temp, t)
        probs = scaled.softmax(dim=-1)
        q = torch.empty_like(probs).exponential_()
        for row, gen in (t.generators or {}).items():
            q[row].exponential_(generator=gen)
        drawn = (probs / q).argmax(dim=-1)
        token_ids = torch.where(t.temperature > 0, drawn, greedy)
    out = SamplerOutput(token_ids=token_ids)
    if raw_logprobs is not None:
        out.logprobs = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        if t.max_logprobs > 0:
            out.top_logprobs, out.top_ids = raw_logprobs.topk(t.max_logprobs, dim=-1)
    return out

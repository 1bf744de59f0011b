"""Rejection sampling of draft tokens (Leviathan et al. 2023, "Fast Inference from Transformers
via Speculative Decoding"; vLLM's rejection sampler): which drafts a verify step keeps, so that
greedy output is the target's argmax token for token and sampled output is distributed exactly
as the target's.

A sequence with drafts d_1..d_n has n + 1 verify rows: row i holds the target's distribution p_i
after the drafts before it (row 0: after its last real token). Walking the rows in order, draft
d_{i+1} is accepted with probability min(1, p_i(d) / q_i(d)), q_i the drafter's distribution (a
drafter that proposes one token deterministically has q_i = 1 at it: the n-gram lookup and the
argmax drafts of a draft model or MTP head); greedy rows accept exactly when d is the argmax.
The first rejection at row i emits a token drawn from the residual max(0, p_i - q_i), normalized
(greedy: the argmax), and ends the run; when every draft is accepted, row n's token is drawn
from p_n (the bonus). Every draw uses the exponential race (argmax of p / E, E ~ Exp(1)), as
the plain sampler does. No host syncs: everything stays on the device until read back.

Deterministic drafts (q_i = 1 at d, every drafter here) need no uniform draw: row i draws its
token t_i from p_i with the race and accepts d exactly when t_i = d. That accepts with
probability p_i(d), as min(1, p_i(d) / 1) does, and a rejected row emits t_i, which given
t_i != d is distributed as p_i with d removed, the residual. With E a function of the request's
seed and the token's position (worker/sampler.py), a seeded request then emits the very tokens
the plain sampler draws, whether speculating or not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class VerifyRows:
    """Where each sequence's verify rows sit: sequence s owns rows offsets[s] ..
    offsets[s] + num_drafts[s] (its drafts' rows, then the bonus row)."""

    offsets: torch.Tensor  # int64 [S]
    num_drafts: torch.Tensor  # int64 [S]
    draft_ids: torch.Tensor  # int64 [S, K]: each sequence's drafts, padded with -1
    row_draft: torch.Tensor  # int64 [R]: the draft each row judges (-1: a bonus row)


def verify_rows(drafts: list[list[int]], device: torch.device) -> VerifyRows:
    """The row layout of sequences with these drafts (any may be empty), on `device`."""
    k = max((len(d) for d in drafts), default=0)
    padded = [d + [-1] * (k - len(d)) for d in drafts]
    row_draft = [t for d in drafts for t in (*d, -1)]
    counts = [len(d) for d in drafts]
    offsets, at = [], 0
    for n in counts:
        offsets.append(at)
        at += n + 1
    return VerifyRows(
        offsets=torch.tensor(offsets, dtype=torch.int64, device=device),
        num_drafts=torch.tensor(counts, dtype=torch.int64, device=device),
        draft_ids=torch.tensor(padded, dtype=torch.int64, device=device).view(len(drafts), k),
        row_draft=torch.tensor(row_draft, dtype=torch.int64, device=device),
    )


def rejection_sample(
    rows: VerifyRows,
    greedy_ids: torch.Tensor,
    greedy_rows: torch.Tensor,
    probs: torch.Tensor | None,
    uniforms: torch.Tensor | None,
    exponentials: torch.Tensor | None,
    draft_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept drafts and draw each sequence's own token.

    greedy_ids `[R]`: the argmax of every row; greedy_rows bool `[R]`: rows that decide by it.
    probs `[R, V]` fp32: the target's distribution of every row (None when every row is greedy);
    exponentials `[R, V]` Exp(1) draws (None likewise); draft_probs `[R, V]`: the drafter's
    distributions (None: deterministic drafts, q = 1 at d), and then uniforms `[R]` in [0, 1)
    (unused for deterministic drafts).

    Returns (tokens `[S, K + 1]`, the accepted drafts then the drawn token, -1 past them;
    num_emitted `[S]`, accepted drafts + 1)."""
    draft = rows.row_draft
    is_draft = draft >= 0
    safe = draft.clamp(min=0)
    accept = greedy_ids == draft
    recovered = greedy_ids
    if probs is not None and draft_probs is None:
        drawn = (probs / exponentials).argmax(dim=-1)
        recovered = torch.where(greedy_rows, greedy_ids, drawn)
        accept = recovered == draft
    elif probs is not None:
        p_draft = probs.gather(1, safe[:, None]).squeeze(1)
        q_draft = draft_probs.gather(1, safe[:, None]).squeeze(1)
        residual = (probs - draft_probs).clamp(min=0).where(is_draft[:, None], probs)
        sampled_accept = uniforms * q_draft < p_draft
        drawn = (residual / exponentials).argmax(dim=-1)
        accept = torch.where(greedy_rows, accept, sampled_accept)
        recovered = torch.where(greedy_rows, greedy_ids, drawn)
    accept &= is_draft
    s, k = rows.draft_ids.shape
    pos = torch.arange(k + 1, device=draft.device)
    row_of = (rows.offsets[:, None] + pos[None, :]).clamp(max=len(draft) - 1)
    within = pos[None, :] < rows.num_drafts[:, None]  # draft positions, not the bonus
    kept = (accept[row_of] & within).to(torch.int64)
    num_accepted = kept.cumprod(dim=1).sum(dim=1)
    drafts = torch.cat([rows.draft_ids, rows.draft_ids.new_full((s, 1), -1)], dim=1)
    tokens = torch.where(pos[None, :] < num_accepted[:, None], drafts, -1)
    own = recovered[rows.offsets + num_accepted]
    tokens.scatter_(1, num_accepted[:, None], own[:, None])
    return tokens, num_accepted + 1

"""Sampling a verify step (speculative decoding): the target's distribution at every row of a
sequence's drafts, each row processed as if the drafts before it were already output, then the
rejection sampler (spec_decode/rejection.py) keeps the accepted run and draws the target's own
token.

Row i of a sequence with drafts d_1..d_n sees d_1..d_i as output tokens: penalties count them,
min_tokens bans stop tokens while they are short of it, a grammar's mask is the one after
consuming them (the scheduler only verifies drafts the grammar accepts). Logprobs are the
target's raw logprobs of each emitted token at its row, as the plain sampler reports them.
"""

from __future__ import annotations

import torch

from atom_runtime.core.sequence import Sequence
from atom_runtime.spec_decode.rejection import rejection_sample, verify_rows
from atom_runtime.worker.sampler import (
    Sampler,
    SamplerOutput,
    exponential_noise,
    greedy_argmax,
    plain_greedy,
    target_distributions,
)


class _Mask:
    """A grammar's mask at one verify row, computed ahead (the matcher has moved on since)."""

    def __init__(self, bitmask: bytes) -> None:
        self.bitmask = bitmask

    def compute_bitmask(self) -> bytes:
        return self.bitmask


class DraftRow:
    """One verify row of a sequence, seen by the sampler as the sequence with `index` of its
    drafts already output."""

    def __init__(self, seq: Sequence, index: int, mask: _Mask | None) -> None:
        self.seq = seq
        self.sampling_params = seq.sampling_params
        self.request_id = seq.request_id
        self.matcher = mask
        self._end = len(seq.token_ids) - seq.num_spec + index  # tokens before this row's own
        self.num_output_tokens = self._end - seq.num_prompt_tokens

    @property
    def output_token_ids(self):
        return self.seq.token_ids[self.seq.num_prompt_tokens : self._end]

    @property
    def prompt_token_ids(self):
        return self.seq.prompt_token_ids


def drafts_of(seq: Sequence) -> list[int]:
    """The drafts the step verifies for seq (placed after its last token)."""
    return seq.token_ids[len(seq.token_ids) - seq.num_spec :].tolist() if seq.num_spec else []


def draft_rows(seqs: list[Sequence]) -> list[DraftRow]:
    """Every verify row of `seqs`, in row order (a sequence's drafts' rows, then its bonus)."""
    rows = []
    for seq in seqs:
        masks = _grammar_masks(seq) if seq.matcher is not None else [None] * (seq.num_spec + 1)
        rows.extend(DraftRow(seq, i, masks[i]) for i in range(seq.num_spec + 1))
    return rows


def _grammar_masks(seq: Sequence) -> list[_Mask]:
    """The grammar's mask before each draft and after the last one (the matcher is walked over
    the drafts and rolled back)."""
    matcher, drafts = seq.matcher, drafts_of(seq)
    masks = [_Mask(bytes(matcher.compute_bitmask()))]
    consumed = 0
    for token in drafts:
        if not matcher.consume_token(token):
            raise RuntimeError(f"{seq!r}: a draft its grammar refuses reached verification")
        consumed += 1
        masks.append(_Mask(bytes(matcher.compute_bitmask())))
    if consumed:
        matcher.rollback(consumed)
    return masks


def verify(
    sampler: Sampler, logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: list[int]
) -> SamplerOutput:
    """logits: `[R, V]` fp32, every sampler's num_spec + 1 rows in order. Returns the emitted
    tokens `[S, K + 1]` and their count per sampler (`SamplerOutput.num_tokens`)."""
    rows = draft_rows(seqs)
    if logits.shape[0] != len(rows):
        raise ValueError(f"logits: {logits.shape[0]} rows for {len(rows)} verify rows")
    drafts = [drafts_of(seq) for seq in seqs]
    if all(plain_greedy(row) for row in rows):
        return SamplerOutput(token_ids=greedy_argmax(logits), drafts=drafts)
    layout = verify_rows(drafts, logits.device)
    t = sampler.tensors(rows, eos_token_ids)
    raw_logprobs, greedy, probs = target_distributions(logits, t)
    exponentials = None if probs is None else exponential_noise(probs, t)
    # Every drafter here proposes deterministically: no uniform draws (rejection.py).
    tokens, counts = rejection_sample(layout, greedy, t.temperature == 0, probs, None, exponentials)
    out = SamplerOutput(token_ids=tokens, num_tokens=counts)
    if raw_logprobs is not None:
        k1 = tokens.shape[1]
        at = layout.offsets[:, None] + torch.arange(k1, device=logits.device)[None, :]
        at = at.clamp(max=len(rows) - 1)
        lps = raw_logprobs[at]  # [S, K + 1, V]
        out.logprobs = lps.gather(2, tokens.clamp(min=0)[..., None]).squeeze(2)
        if t.max_logprobs > 0:
            out.top_logprobs, out.top_ids = lps.topk(t.max_logprobs, dim=-1)
    return out


def flatten_verified(out: SamplerOutput) -> tuple[list[int], list[int], list | None, list, list]:
    """A verify step's samples, read back, as one row per emitted token: (counts, token ids,
    logprobs, top ids, top logprobs); the last three None without logprobs."""
    if out.drafts is not None:
        return _accepted_greedy(out.drafts, out.token_ids.tolist())
    counts = out.num_tokens.tolist()
    tokens = out.token_ids.tolist()
    flat = [t for row, n in zip(tokens, counts, strict=True) for t in row[:n]]

    def rows(t: torch.Tensor | None):
        if t is None:
            return None
        return [v for row, n in zip(t.tolist(), counts, strict=True) for v in row[:n]]

    return counts, flat, rows(out.logprobs), rows(out.top_ids), rows(out.top_logprobs)


def _accepted_greedy(drafts: list[list[int]], argmax: list[int]) -> tuple:
    """A greedy verify step's emitted tokens from every row's argmax: each sampler keeps its
    drafts up to the first one that is not its row's argmax, then that row's argmax (the bonus
    row's when all were kept), as `rejection_sample` decides greedy rows."""
    counts, flat, at = [], [], 0
    for row in drafts:
        n = 0
        while n < len(row) and row[n] == argmax[at + n]:
            n += 1
        flat += argmax[at : at + n + 1]  # the kept drafts are their rows' argmax
        counts.append(n + 1)
        at += len(row) + 1
    return counts, flat, None, None, None

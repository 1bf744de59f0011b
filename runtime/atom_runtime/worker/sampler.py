"""The sampler: penalties, logit bias, allowed tokens, temperature, top-k, top-p and min-p, then a draw — all torch ops on the
logits' device, so a GPU step needs no host round trip until the sampled ids are read back.

Unseeded rows draw with the exponential-race trick (argmax of p / q, q ~ Exp(1)) in one batched op.
A seeded row's q is a function of its seed and the position of the token it draws alone (`row_seed`),
not of how many draws came before: a seed gives the same tokens in any batch, after a preemption,
and with or without speculative decoding (whose verify rows draw with the same q,
spec_decode/rejection.py).
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import xxhash

from atom_runtime.system.device import to_device
from atom_runtime.text.structured_outputs import fill_bitmasks

if TYPE_CHECKING:
    from atom_runtime.core.sequence import Sequence


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
    # Seeded rows: row -> the seed of its draw (`row_seed`), and the generator that draws them.
    seeds: dict[int, int] | None = None
    generator: torch.Generator | None = None
    max_logprobs: int = -1  # -1: no logprobs wanted in this batch


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [S] int64
    logprobs: torch.Tensor | None = None  # [S] the sampled token's logprob
    top_ids: torch.Tensor | None = None  # [S, k]
    top_logprobs: torch.Tensor | None = None  # [S, k]
    # A verify step (speculative decoding): each sampler emits num_tokens[s] tokens, and the
    # tensors above gain a dimension: token_ids [S, K + 1] (-1 past them), logprobs [S, K + 1],
    # top_* [S, K + 1, k].
    num_tokens: torch.Tensor | None = None
    # A greedy verify step (every row decided by its argmax): token_ids holds each verify row's
    # argmax [R] and these are the drafts each sampler verified; the accepted run is found on
    # the host once the argmaxes are read back (no rejection-sampling kernels, no uploads).
    drafts: list[list[int]] | None = None


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


def target_distributions(
    logits: torch.Tensor, t: SamplingTensors
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """What each row samples from: (the raw logprobs when logprobs are wanted, the argmax after
    penalties, bias, masks and bans, and the probabilities after temperature, top-k, top-p and
    min-p; None when every row is greedy). logits: [S, V] fp32."""
    raw_logprobs = logits.log_softmax(dim=-1) if t.max_logprobs >= 0 else None
    logits = apply_bias_and_allowed(apply_penalties(logits, t), t)
    if t.banned_rows is not None:
        logits = logits.index_put((t.banned_rows, t.banned_tokens), torch.tensor(float("-inf")))
    greedy = logits.argmax(dim=-1)
    if t.all_greedy:
        return raw_logprobs, greedy, None
    temp = torch.where(t.temperature > 0, t.temperature, 1.0).unsqueeze(1)
    probs = apply_top_k_top_p_min_p(logits / temp, t).softmax(dim=-1)
    return raw_logprobs, greedy, probs


def row_seed(seed: int, position: int) -> int:
    """The seed of a seeded request's draw of its output token at `position` (0: the first):
    its draws depend on nothing else, whichever batch, step or verify row makes them."""
    return xxhash.xxh3_64_intdigest(struct.pack("<qq", seed, position))


def exponential_noise(probs: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Exp(1) draws shaped like probs; a seeded row's from the generator set to its row seed (on
    a GPU the seed is read at the launch: one generator serves every row)."""
    q = torch.empty_like(probs).exponential_()
    for row, seed in (t.seeds or {}).items():
        q[row].exponential_(generator=t.generator.manual_seed(seed))
    return q


def sample(logits: torch.Tensor, t: SamplingTensors) -> SamplerOutput:
    """logits: [S, V] fp32 (one row per sequence that samples this step)."""
    raw_logprobs, greedy, probs = target_distributions(logits, t)
    if probs is None:
        token_ids = greedy
    else:
        drawn = (probs / exponential_noise(probs, t)).argmax(dim=-1)
        token_ids = torch.where(t.temperature > 0, drawn, greedy)
    out = SamplerOutput(token_ids=token_ids)
    if raw_logprobs is not None:
        out.logprobs = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        if t.max_logprobs > 0:
            out.top_logprobs, out.top_ids = raw_logprobs.topk(t.max_logprobs, dim=-1)
    return out


class Sampler:
    """One token per sampling sequence of a step, each row drawn with its request's parameters.
    Owns the generator of seeded rows (made at the first), reseeded for each draw."""

    def __init__(self, device: torch.device, vocab_size: int) -> None:
        self.device = device
        self.vocab_size = vocab_size
        self.generator: torch.Generator | None = None

    def __call__(
        self, logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: list[int]
    ) -> SamplerOutput:
        """Rows of `logits` in the order of `seqs`; `eos_token_ids` are banned (with the stop
        token ids) in rows short of their min_tokens."""
        if logits.shape[0] != len(seqs):
            raise ValueError(f"logits: {logits.shape[0]} rows for {len(seqs)} sequences")
        if all(plain_greedy(seq) for seq in seqs):
            return SamplerOutput(token_ids=greedy_argmax(logits))
        return sample(logits, self.tensors(seqs, eos_token_ids))

    def tensors(self, seqs: list[Sequence], eos_token_ids: list[int]) -> SamplingTensors:
        """The per-row parameters of `seqs` on the device (host arrays copied without a sync)."""
        dev = self.device
        params = [seq.sampling_params for seq in seqs]
        temps = [0.0 if p.greedy else p.temperature for p in params]
        top_k = [p.top_k if p.top_k > 0 else 0 for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        t = SamplingTensors(
            temperature=to_device(np.array(temps, dtype=np.float32), dev),
            top_k=to_device(np.array(top_k, dtype=np.int64), dev),
            top_p=to_device(np.array(top_p, dtype=np.float32), dev),
            min_p=to_device(np.array(min_p, dtype=np.float32), dev),
            all_greedy=all(x == 0.0 for x in temps),
            any_top_k=any(top_k),
            any_top_p=any(p < 1.0 for p in top_p),
            any_min_p=any(p > 0 for p in min_p),
            max_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=-1),
        )
        vocab = self.vocab_size
        if any(p.has_penalties for p in params):
            counts = torch.zeros((len(seqs), vocab), dtype=torch.float32, device=dev)
            prompt_mask = torch.zeros((len(seqs), vocab), dtype=torch.bool, device=dev)
            for row, seq in enumerate(seqs):
                if not seq.sampling_params.has_penalties:
                    continue  # neutral row (its tokens may still be pending under async)
                out_ids = torch.from_numpy(np.asarray(seq.output_token_ids, dtype=np.int64)).to(dev)
                counts[row].index_add_(0, out_ids, torch.ones_like(out_ids, dtype=torch.float32))
                prompt_ids = torch.from_numpy(np.asarray(seq.prompt_token_ids, dtype=np.int64)).to(
                    dev
                )
                prompt_mask[row, prompt_ids] = True
            t.output_counts, t.prompt_mask = counts, prompt_mask
            t.presence = torch.tensor([p.presence_penalty for p in params], device=dev)
            t.frequency = torch.tensor([p.frequency_penalty for p in params], device=dev)
            t.repetition = torch.tensor([p.repetition_penalty for p in params], device=dev)
        banned_rows, banned_tokens = [], []
        bias: tuple[list, list, list] = ([], [], [])
        allowed: tuple[list, list, list] = ([], [], [])
        for row, seq in enumerate(seqs):
            p = seq.sampling_params
            for tok, value in (p.logit_bias or {}).items():
                for column, item in zip(bias, (row, tok, value), strict=True):
                    column.append(item)
            if p.allowed_token_ids is not None:
                allowed[0].append(row)
                allowed[1].extend([len(allowed[0]) - 1] * len(p.allowed_token_ids))
                allowed[2].extend(p.allowed_token_ids)
            if seq.num_output_tokens < p.min_tokens:
                stop_ids = set(p.stop_token_ids or ())
                if not p.ignore_eos:
                    stop_ids.update(eos_token_ids)
                for tok in stop_ids:
                    banned_rows.append(row)
                    banned_tokens.append(tok)
            if p.seed is not None and not p.greedy:
                if self.generator is None:
                    self.generator = torch.Generator(dev)
                t.generator = self.generator
                t.seeds = t.seeds or {}
                t.seeds[row] = row_seed(p.seed, seq.num_output_tokens)
        if bias[0]:
            t.bias_rows = to_device(np.array(bias[0], dtype=np.int64), dev)
            t.bias_tokens = to_device(np.array(bias[1], dtype=np.int64), dev)
            t.bias_values = to_device(np.array(bias[2], dtype=np.float32), dev)
        guided = [row for row, seq in enumerate(seqs) if seq.matcher is not None]
        if guided:
            masks = fill_bitmasks([seqs[row].matcher for row in guided], vocab)
            t.guided_rows = to_device(np.array(guided, dtype=np.int64), dev)
            t.guided_bitmask = to_device(masks, dev)
        if allowed[0]:
            t.allowed_rows, t.allowed_index, t.allowed_tokens = (
                to_device(np.array(column, dtype=np.int64), dev) for column in allowed
            )
        if banned_rows:
            t.banned_rows = to_device(np.array(banned_rows, dtype=np.int64), dev)
            t.banned_tokens = to_device(np.array(banned_tokens, dtype=np.int64), dev)
        return t


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(-1)` (the first maximum of each row) in two stages: the maximum of each
    of many vocabulary chunks in parallel, then of the chunk maxima. A single-stage argmax
    over a 128k vocabulary runs one long reduction per row (27 us for one row on an H200)."""
    rows, vocab = logits.shape
    chunk = _argmax_chunk(vocab)
    if chunk == 0:
        return logits.argmax(dim=-1)
    values, within = logits.reshape(rows, vocab // chunk, chunk).max(dim=-1)  # first max per chunk
    best = values.argmax(dim=-1, keepdim=True)  # first chunk holding the row's maximum
    return (best * chunk + within.gather(1, best)).squeeze(1)


@functools.lru_cache(maxsize=8)
def _argmax_chunk(vocab: int) -> int:
    """The largest divisor of vocab in [64, 1024], or 0 when there is none."""
    return next((c for c in range(1024, 63, -1) if vocab % c == 0), 0)


def plain_greedy(seq: Sequence) -> bool:
    """Argmax alone decides this row: greedy, no logprobs, no penalties, no logit edits, no
    banned tokens."""
    p = seq.sampling_params
    return (
        p.greedy
        and p.logprobs is None
        and not p.has_penalties
        and not p.edits_logits
        and seq.num_output_tokens >= p.min_tokens
    )

"""The rejection sampler keeps the target's distribution: greedy rows accept exactly the argmax
run; sampled rows, iterated over many draws on a tiny vocabulary, give token sequences whose
frequencies pass a chi-square test against the target's own autoregressive distribution, for
deterministic drafts (the n-gram lookup, argmax drafters) and for drafts with probabilities of
their own; a sampler that skips the rejection fails the same test."""

from __future__ import annotations

import itertools

import pytest
import torch

from atom_runtime.spec_decode.rejection import rejection_sample, verify_rows
from atom_runtime.worker.sampler import SamplerOutput
from atom_runtime.worker.verify_sampler import flatten_verified

V = 4  # vocabulary
# A Markov target: p(next | previous), rows sum to 1.
TARGET = torch.tensor(
    [[0.5, 0.2, 0.2, 0.1], [0.1, 0.6, 0.1, 0.2], [0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1]]
)
# A drafter with its own (wrong) Markov distribution.
DRAFTER = torch.tensor(
    [[0.1, 0.7, 0.1, 0.1], [0.3, 0.3, 0.2, 0.2], [0.6, 0.1, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]]
)
LENGTH = 3  # tokens of each drawn sequence judged


def test_greedy_accepts_the_argmax_run_and_emits_the_targets_token():
    rows = verify_rows([[2, 3, 1], [], [0]], torch.device("cpu"))
    greedy = torch.tensor([2, 3, 0, 1, 5, 0, 4])  # seq 0 rejects its 3rd draft (0, not 1)
    tokens, counts = rejection_sample(
        rows, greedy, torch.ones(7, dtype=torch.bool), None, None, None
    )
    assert counts.tolist() == [3, 1, 2]
    assert tokens.tolist() == [[2, 3, 0, -1], [5, -1, -1, -1], [0, 4, -1, -1]]


def test_host_greedy_acceptance_matches_the_device_rejection_sampler():
    """A greedy verify step decides its accepted run on the host (`flatten_verified` of the
    argmaxes); it emits what `rejection_sample` emits for the same rows, tokens and counts."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        drafts = [
            torch.randint(0, 3, (int(n),), generator=gen).tolist()
            for n in torch.randint(
                0, 5, (int(torch.randint(1, 5, (1,), generator=gen)),), generator=gen
            )
        ]
        argmax = torch.randint(0, 3, (sum(len(d) + 1 for d in drafts),), generator=gen)
        rows = verify_rows(drafts, torch.device("cpu"))
        ones = torch.ones(len(argmax), dtype=torch.bool)
        tokens, counts = rejection_sample(rows, argmax, ones, None, None, None)
        want = [t for row, n in zip(tokens.tolist(), counts.tolist(), strict=True) for t in row[:n]]
        got = flatten_verified(SamplerOutput(token_ids=argmax, drafts=drafts))
        assert got[:2] == (counts.tolist(), want)


def _run(draft_mode: str, n: int, k: int, seed: int, broken: bool = False) -> torch.Tensor:
    """n streams from token 0, extended by verify steps until LENGTH tokens; the first LENGTH
    of each, as one code per stream."""
    gen = torch.Generator().manual_seed(seed)
    streams = torch.zeros((n, 1), dtype=torch.int64)
    out = torch.full((n, LENGTH), -1, dtype=torch.int64)
    have = torch.zeros(n, dtype=torch.int64)
    last = torch.zeros(n, dtype=torch.int64)
    while (have < LENGTH).any():
        drafts, q_rows = [], []
        for s in range(n):
            prev, ds, qs = int(last[s]), [], []
            for _ in range(k):
                q = DRAFTER[prev] if draft_mode == "probs" else torch.eye(V)[(prev + 1) % V]
                tok = int(torch.multinomial(q, 1, generator=gen))
                ds.append(tok)
                qs.append(q)
                prev = tok
            drafts.append(ds)
            q_rows.extend([*qs, torch.zeros(V)])
        rows = verify_rows(drafts, torch.device("cpu"))
        contexts = [c for s in range(n) for c in [int(last[s]), *drafts[s]]]
        probs = TARGET[torch.tensor(contexts)]
        r = len(contexts)
        uniforms = torch.rand(r, generator=gen)
        if broken:
            uniforms = torch.zeros(r)  # accepts every draft: the drafter's distribution leaks
        exps = torch.empty(r, V).exponential_(generator=gen)
        q = torch.stack(q_rows) if draft_mode == "probs" else None
        tokens, counts = rejection_sample(
            rows, probs.argmax(-1), torch.zeros(r, dtype=torch.bool), probs, uniforms, exps, q
        )
        for s in range(n):
            for t in tokens[s, : counts[s]].tolist():
                if have[s] < LENGTH:
                    out[s, have[s]] = t
                    have[s] += 1
            last[s] = tokens[s, counts[s] - 1]
    del streams
    return out


def _chi_square_p(sequences: torch.Tensor) -> float:
    """p-value of the observed sequence frequencies against the target's chain from token 0."""
    cells = list(itertools.product(range(V), repeat=LENGTH))
    expected = []
    for cell in cells:
        p, prev = 1.0, 0
        for t in cell:
            p *= float(TARGET[prev, t])
            prev = t
        expected.append(p * len(sequences))
    codes = (sequences * torch.tensor([V**i for i in reversed(range(LENGTH))])).sum(-1)
    observed = torch.bincount(codes, minlength=V**LENGTH).double()
    expected = torch.tensor(expected, dtype=torch.float64)
    stat = ((observed - expected) ** 2 / expected).sum()
    dof = torch.tensor((len(cells) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, stat / 2))


@pytest.mark.parametrize(("mode", "k"), [("deterministic", 2), ("probs", 3)])
def test_sampled_sequences_follow_the_target_distribution(mode, k):
    assert _chi_square_p(_run(mode, n=6000, k=k, seed=11)) > 1e-3


def test_skipping_the_rejection_fails_the_same_test():
    assert _chi_square_p(_run("probs", n=6000, k=3, seed=11, broken=True)) < 1e-6

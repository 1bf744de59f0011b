"""Sampler properties: the top-k/top-p/min-p masks, greedy rows, seeded reproducibility, penalties,
and SamplingParams validation naming the field."""

from __future__ import annotations

import pytest
import torch

from atom_runtime.sampling_params import SamplingParams
from atom_runtime.worker.sampler import (
    SamplingTensors,
    apply_top_k_top_p_min_p,
    row_seed,
    sample,
)


def _tensors(n, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, **kw) -> SamplingTensors:
    return SamplingTensors(
        temperature=torch.full((n,), temperature),
        top_k=torch.full((n,), top_k, dtype=torch.int64),
        top_p=torch.full((n,), top_p),
        min_p=torch.full((n,), min_p),
        all_greedy=temperature == 0,
        any_top_k=top_k > 0,
        any_top_p=top_p < 1,
        any_min_p=min_p > 0,
        **kw,
    )


def test_top_k_keeps_exactly_k_tokens():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    masked = apply_top_k_top_p_min_p(logits, _tensors(3, top_k=5))
    kept = torch.isfinite(masked)
    assert kept.sum(dim=1).tolist() == [5, 5, 5]
    assert torch.equal(kept, torch.zeros_like(kept).scatter_(1, logits.topk(5).indices, True))


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    masked = apply_top_k_top_p_min_p(probs.log(), _tensors(1, top_p=0.75))
    assert torch.isfinite(masked).tolist() == [[True, True, False, False]]
    masked = apply_top_k_top_p_min_p(probs.log(), _tensors(1, top_p=0.81))
    assert torch.isfinite(masked).tolist() == [[True, True, True, False]]


def test_min_p_drops_tokens_below_the_scaled_threshold():
    probs = torch.tensor([[0.6, 0.3, 0.07, 0.03]])
    masked = apply_top_k_top_p_min_p(probs.log(), _tensors(1, min_p=0.1))
    assert torch.isfinite(masked).tolist() == [[True, True, True, False]]


def test_samples_stay_inside_the_top_k_set():
    logits = torch.randn(64, 100, generator=torch.Generator().manual_seed(1))
    out = sample(logits, _tensors(64, temperature=1.0, top_k=3))
    allowed = logits.topk(3).indices
    assert all(out.token_ids[i] in allowed[i] for i in range(64))


def test_greedy_is_argmax():
    logits = torch.randn(8, 30, generator=torch.Generator().manual_seed(2))
    out = sample(logits, _tensors(8, temperature=0.0))
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_seeded_rows_are_reproducible_regardless_of_the_batch():
    """A seeded row's draw is a function of its seed and position: the same in any batch (at
    any row), in any order of positions, and different across positions and seeds."""
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(3))
    gen = torch.Generator()

    def draw(batch_rows: int, row: int, seed: int, positions) -> list[int]:
        tokens = []
        for pos in positions:
            batch = logits.repeat(batch_rows, 1)
            t = _tensors(batch_rows, seeds={row: row_seed(seed, pos)}, generator=gen)
            tokens.append(sample(batch, t).token_ids[row].item())
        return tokens

    one = draw(1, 0, 1234, range(6))
    assert one == draw(7, 4, 1234, range(6))
    assert one[::-1] == draw(3, 1, 1234, reversed(range(6)))
    assert len(set(one)) > 1  # it really samples
    assert one != draw(1, 0, 1235, range(6))


def test_penalties_lower_seen_tokens():
    logits = torch.zeros(1, 4)
    counts = torch.tensor([[2.0, 0.0, 0.0, 0.0]])
    t = _tensors(
        1,
        temperature=0.0,
        output_counts=counts,
        prompt_mask=torch.tensor([[False, True, False, False]]),
        presence=torch.tensor([0.5]),
        frequency=torch.tensor([0.25]),
        repetition=torch.tensor([1.0]),
    )
    from atom_runtime.worker.sampler import apply_penalties

    assert apply_penalties(logits, t).tolist() == [[-1.0, 0.0, 0.0, 0.0]]


def _bias_and_allowed(bias: dict[int, dict[int, float]], allowed: dict[int, list[int]]) -> dict:
    """SamplingTensors fields as the model runner builds them: bias {row: {token: value}},
    allowed {row: [tokens]}."""
    triples = [(r, tok, v) for r, b in bias.items() for tok, v in b.items()]
    rows = sorted(allowed)
    pairs = [(i, tok) for i, r in enumerate(rows) for tok in allowed[r]]
    kw = {}
    if triples:
        kw["bias_rows"] = torch.tensor([r for r, _, _ in triples])
        kw["bias_tokens"] = torch.tensor([tok for _, tok, _ in triples])
        kw["bias_values"] = torch.tensor([v for _, _, v in triples], dtype=torch.float32)
    if rows:
        kw["allowed_rows"] = torch.tensor(rows)
        kw["allowed_index"] = torch.tensor([i for i, _ in pairs])
        kw["allowed_tokens"] = torch.tensor([tok for _, tok in pairs])
    return kw


def test_logit_bias_and_allowed_tokens_steer_each_row_alone():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(5))
    best = logits.argmax(-1)
    second = logits.topk(2).indices[:, 1]
    kw = _bias_and_allowed(
        {0: {7: 100.0}, 1: {int(best[1]): -100.0}}, {2: [3, 9], 3: [int(second[3]), 11]}
    )
    out = sample(logits, _tensors(4, temperature=0.0, max_logprobs=0, **kw))
    want_2 = 3 if logits[2, 3] >= logits[2, 9] else 9
    want_3 = int(second[3]) if logits[3, second[3]] >= logits[3, 11] else 11
    assert out.token_ids.tolist() == [7, int(second[1]), want_2, want_3]
    # Logprobs stay those of the model's own distribution, as with the penalties.
    ref = logits.log_softmax(-1).gather(1, out.token_ids[:, None]).squeeze(1)
    assert torch.allclose(out.logprobs, ref)


def test_sampled_tokens_stay_inside_the_allowed_set():
    logits = torch.randn(32, 100, generator=torch.Generator().manual_seed(6))
    allowed = {row: [row, 50 + row, 99] for row in range(0, 32, 2)}
    kw = _bias_and_allowed({1: {42: 100.0}}, allowed)
    for _ in range(5):
        out = sample(logits, _tensors(32, temperature=1.5, **kw))
        for row, tokens in allowed.items():
            assert out.token_ids[row].item() in tokens
        assert out.token_ids[1].item() == 42  # +100 outweighs any other logit here
    assert len({sample(logits, _tensors(32, **kw)).token_ids[0].item() for _ in range(20)}) > 1


def test_logprobs_are_raw_log_softmax():
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(4))
    out = sample(logits, _tensors(2, temperature=0.0, max_logprobs=3))
    ref = logits.log_softmax(-1)
    assert torch.allclose(out.logprobs, ref.gather(1, out.token_ids[:, None]).squeeze(1))
    assert torch.equal(out.top_ids, ref.topk(3).indices)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),
        ({"seed": 2**63}, "seed"),
        ({"max_tokens": 2**63}, "max_tokens"),
        ({"top_k": True}, "top_k"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"seed": "x"}, "seed"),
        ({"logit_bias": {5: 101}}, "logit_bias"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [3, -1]}, "allowed_token_ids"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}: "):
        SamplingParams(**kwargs)


def test_stop_string_becomes_a_list():
    assert SamplingParams(stop="###").stop == ["###"]


@pytest.mark.parametrize("vocab", [128256, 151936, 49152, 1009, 100])
def test_greedy_argmax_is_argmax_first_maximum_included(vocab):
    from atom_runtime.worker.sampler import greedy_argmax

    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(6, vocab, generator=g)
    x[1, 3] = x[1, vocab - 1] = 50.0  # a tie across chunks: the first index wins
    x[2] = 0.0  # all equal: index 0
    x[3, 7] = x[3, 8] = 50.0  # a tie within one chunk
    for t in (x, x.bfloat16()):
        assert torch.equal(greedy_argmax(t), t.argmax(dim=-1))

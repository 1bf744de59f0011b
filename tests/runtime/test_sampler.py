"""Sampler properties: the top-k/top-p/min-p masks, greedy rows, seeded reproducibility, penalties,
and SamplingParams validation naming the field."""

from __future__ import annotations

import pytest
import torch

from atom_runtime.layers.sampler import SamplingTensors, apply_top_k_top_p_min_p, sample
from atom_runtime.sampling_params import SamplingParams


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
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(3))

    def draw(batch_rows: int) -> list[int]:
        gen = torch.Generator().manual_seed(1234)
        tokens = []
        for _ in range(5):
            batch = logits.repeat(batch_rows, 1)
            out = sample(batch, _tensors(batch_rows, generators={0: gen}))
            tokens.append(out.token_ids[0].item())
        return tokens

    assert draw(1) == draw(7)
    assert len(set(draw(1))) > 1  # it really samples


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
    from atom_runtime.layers.sampler import apply_penalties

    assert apply_penalties(logits, t).tolist() == [[-1.0, 0.0, 0.0, 0.0]]


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
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logprobs": 21}, "logprobs"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"seed": "x"}, "seed"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}: "):
        SamplingParams(**kwargs)


def test_stop_string_becomes_a_list():
    assert SamplingParams(stop="###").stop == ["###"]


@pytest.mark.parametrize("vocab", [128256, 151936, 49152, 1009, 100])
def test_greedy_argmax_is_argmax_first_maximum_included(vocab):
    from atom_runtime.model_runner import greedy_argmax

    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(6, vocab, generator=g)
    x[1, 3] = x[1, vocab - 1] = 50.0  # a tie across chunks: the first index wins
    x[2] = 0.0  # all equal: index 0
    x[3, 7] = x[3, 8] = 50.0  # a tie within one chunk
    for t in (x, x.bfloat16()):
        assert torch.equal(greedy_argmax(t), t.argmax(dim=-1))

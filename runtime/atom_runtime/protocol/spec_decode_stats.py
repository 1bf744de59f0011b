"""Counters of speculative decoding, with vLLM's meanings under `atom:` names (contract 8).

A "draft" is one sequence's verify step that carried at least one draft token. Per draft, the
rejection sampler accepts a leading run of its draft tokens; the step then emits those plus one
token of the target's own (the bonus or the correction). vLLM's metrics, `atom:` prefixed:

- `atom:spec_decode_num_drafts_total`: drafts verified.
- `atom:spec_decode_num_draft_tokens_total`: draft tokens verified.
- `atom:spec_decode_num_accepted_tokens_total`: draft tokens accepted.
- `atom:spec_decode_num_emitted_tokens_total`: tokens the verify steps of drafts emitted (the
  accepted ones plus the target's own token each; vLLM v0's counter of that name).
- `atom:spec_decode_num_accepted_tokens_per_pos_total{position}`: drafts whose token at
  `position` (0: the first draft token) was accepted.
- `atom:spec_decode_acceptance_length`: a histogram of tokens emitted per draft (accepted + 1),
  the mean acceptance length; vLLM derives its mean from the counters above.

The scheduler counts into one `SpecDecodingStats`; the engine copies it into its stats message,
the API server's collector renders it, `atom bench` prints it.
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec


class SpecDecodingStats(msgspec.Struct, array_like=True):
    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [k]: drafts whose token at each position was accepted.
    accepted_per_pos: list[int] = []
    # [k + 1]: drafts that emitted 1..k+1 tokens (acceptance lengths).
    acceptance_lengths: list[int] = []

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * k
        if not self.acceptance_lengths:
            self.acceptance_lengths = [0] * (k + 1)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One sequence's verify step: `num_draft_tokens` drafted, the first `num_accepted`
        accepted."""
        if num_draft_tokens <= 0:
            return
        if not 0 <= num_accepted <= num_draft_tokens <= self.num_speculative_tokens:
            raise ValueError(
                f"num_accepted: {num_accepted} of {num_draft_tokens} drafts "
                f"(k = {self.num_speculative_tokens})"
            )
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1
        self.acceptance_lengths[num_accepted] += 1

    def reset(self) -> None:
        k = self.num_speculative_tokens
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * k
        self.acceptance_lengths = [0] * (k + 1)

    @property
    def num_emitted_tokens(self) -> int:
        """Tokens emitted by verify steps that carried drafts: accepted + one each."""
        return self.num_accepted_tokens + self.num_drafts

    @property
    def acceptance_rate(self) -> float:
        """Accepted over drafted tokens (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per draft: 1 + accepted / drafts (vLLM's mean acceptance length)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def summary(self) -> dict:
        """The figures `atom bench` prints and writes."""
        return {
            "num_speculative_tokens": self.num_speculative_tokens,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_emitted_tokens": self.num_emitted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "accepted_per_pos": list(self.accepted_per_pos),
            "acceptance_lengths": list(self.acceptance_lengths),
        }

    def prometheus_families(self) -> Iterator:
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        for name, doc, value in (
            ("num_drafts", "Verify steps of a sequence that carried drafts.", self.num_drafts),
            ("num_draft_tokens", "Draft tokens verified.", self.num_draft_tokens),
            ("num_accepted_tokens", "Draft tokens accepted.", self.num_accepted_tokens),
            (
                "num_emitted_tokens",
                "Tokens emitted by verify steps with drafts (accepted + 1 each).",
                self.num_emitted_tokens,
            ),
        ):
            yield CounterMetricFamily(f"atom:spec_decode_{name}", doc, value=value)
        per_pos = CounterMetricFamily(
            "atom:spec_decode_num_accepted_tokens_per_pos",
            "Drafts whose token at this position (0: the first) was accepted.",
            labels=["position"],
        )
        for pos, value in enumerate(self.accepted_per_pos):
            per_pos.add_metric([str(pos)], value)
        yield per_pos
        buckets, running = [], 0
        for length, count in enumerate(self.acceptance_lengths, start=1):
            running += count
            buckets.append((str(float(length)), running))
        buckets.append(("+Inf", running))
        total = sum(n * count for n, count in enumerate(self.acceptance_lengths, start=1))
        yield HistogramMetricFamily(
            "atom:spec_decode_acceptance_length",
            "Tokens emitted per draft (accepted drafts + 1).",
            buckets=buckets,
            sum_value=total,
        )

"""Which producer rank holds which KV heads a decode rank owns: the head plan of a transfer
between engines of different tensor-parallel sizes.

A model's attention layers have `heads` KV heads. Under tensor parallelism of size t, rank r
holds KV heads [r * heads / t, (r + 1) * heads / t) when t <= heads (the heads are split), and
the one head r * heads // t when t > heads (each head is replicated on t / heads ranks), as
`QKVParallelLinear` loads them. An MLA latent cache has no heads: every rank holds all of it.

A consumer rank of a decode engine at tensor-parallel size d needs exactly its own heads, from
the producer ranks of the prefill engine (size p) that hold them: one producer rank when d >= p
(a slice of that rank's heads, or all of them), p / d ranks when d < p (each rank's heads into a
slice of its own). A replicated head is read from one of the ranks holding it, chosen by the
consumer's rank so the reads spread over them. Pure functions; a transfer checks them once.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadSource:
    """Part of one consumer rank's cache and where it comes from: heads `src` of producer rank
    `rank` (indices in that rank's cache) go to heads `dst` of the consumer rank's cache.
    None for `src`/`dst`: every head of that side (whole blocks move)."""

    rank: int
    src: tuple[int, int] | None
    dst: tuple[int, int] | None


def check_tp(heads: int, tp: int, who: str) -> None:
    """ValueError unless `tp` ranks can hold `heads` KV heads (one divides the other)."""
    if tp < 1:
        raise ValueError(f"{who}: tensor_parallel_size must be >= 1, got {tp}")
    if heads % tp and tp % heads:
        raise ValueError(
            f"{who}: {heads} KV heads cannot be split over tensor_parallel_size {tp} (one must "
            "divide the other)"
        )


def rank_heads(rank: int, tp: int, heads: int) -> tuple[int, int]:
    """The global KV heads [first, end) tensor-parallel rank `rank` of `tp` holds."""
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is not one of {tp} tensor-parallel ranks")
    first = rank * heads // tp
    return first, first + max(1, heads // tp)


def plan_sources(
    heads: int | None, producer_tp: int, consumer_tp: int, consumer_rank: int
) -> list[HeadSource]:
    """Where consumer rank `consumer_rank` of `consumer_tp` reads its part of each block from,
    for a model of `heads` KV heads (None: a latent cache every rank holds whole). Raises
    ValueError naming the sizes when a head split does not line up."""
    if heads is None:  # replicated everywhere: one read from any producer rank
        check_tp(1, producer_tp, "prefill engine")
        return [HeadSource(consumer_rank % producer_tp, None, None)]
    check_tp(heads, producer_tp, "prefill engine")
    check_tp(heads, consumer_tp, "decode engine")
    want = rank_heads(consumer_rank, consumer_tp, heads)
    producers = [rank_heads(q, producer_tp, heads) for q in range(producer_tp)]
    out: list[HeadSource] = []
    head = want[0]
    while head < want[1]:
        holders = [q for q, (a, b) in enumerate(producers) if a <= head < b]
        q = holders[consumer_rank % len(holders)]
        a, b = producers[q]
        end = min(b, want[1])
        src = (head - a, end - a)
        dst = (head - want[0], end - want[0])
        out.append(
            HeadSource(
                q,
                None if src == (0, b - a) else src,
                None if dst == (0, want[1] - want[0]) else dst,
            )
        )
        head = end
    return out

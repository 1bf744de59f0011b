"""Sliding-window attention and attention sinks (GPT-OSS, Mistral) in the paged decode and
prefill kernels and their torch references, against an independent float64 attention.

Block-table entries wholly before a sequence's window point at a block of NaN (the window's
blocks a model gave back may hold anything), so a kernel that reads before its window, or
past any mask, shows NaN. Under TRITON_INTERPRET=1 on CPU (fp32) or compiled on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from paged_cases import make_paged_case

from atom_kernels import reference

SCALE = 0.3


def _naive(q, k, v, first_position: int, window: int, sinks) -> torch.Tensor:
    """float64 attention of one sequence (scores scaled by SCALE): query i at
    first_position + i sees keys
    max(0, p - window + 1)..p (all of 0..p without a window); a sink adds exp(sink) to the
    denominator of its head."""
    q_len, num_heads, _ = q.shape
    group = num_heads // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for h in range(num_heads):
        kh, vh = k[:, h // group].double(), v[:, h // group].double()
        for i in range(q_len):
            p = first_position + i
            lo = max(0, p - window + 1) if window else 0
            scores = kh[lo : p + 1] @ q[i, h].double() * SCALE
            top = scores.max()
            if sinks is not None:
                top = torch.maximum(top, sinks[h].double())
            weights = torch.exp(scores - top)
            denom = weights.sum() + (torch.exp(sinks[h].double() - top) if sinks is not None else 0)
            out[i, h] = weights @ vh[lo : p + 1] / denom
    return out


def _windowed_case(seq_lens, window, block_size, num_kv_heads, head_dim, seed):
    """A paged case whose block-table entries wholly before the last query's window point at a
    spare block of NaN; also returns each sequence's keys and values in order."""
    g = torch.Generator().manual_seed(seed)
    case = make_paged_case(
        seq_lens, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
        dtype=torch.float32, generator=g, pad_value=0,
    )  # fmt: skip
    used = set(case.block_tables.flatten().tolist())
    spare = next(b for b in range(case.k_cache.shape[0]) if b not in used)
    keys, values = [], []
    for b, n in enumerate(seq_lens):
        rows = [(int(case.block_tables[b, p // block_size]), p % block_size) for p in range(n)]
        keys.append(torch.stack([case.k_cache[blk, off] for blk, off in rows]) if n else None)
        values.append(torch.stack([case.v_cache[blk, off] for blk, off in rows]) if n else None)
    return case, keys, values, spare, g


def _free_before(case, b: int, first_key: int, block_size: int, spare: int) -> None:
    for i in range(first_key // block_size):
        case.block_tables[b, i] = spare


@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize(("window", "num_splits"), [(5, 1), (16, 1), (24, 3), (1000, 2)])
def test_decode_window_and_sinks(kernels, device, window, num_splits, with_sinks):
    seq_lens, bs, heads, kv_heads, d = [1, 7, 16, 37, 90, 0], 8, 6, 2, 32
    case, keys, values, spare, g = _windowed_case(seq_lens, window, bs, kv_heads, d, 21)
    for b, n in enumerate(seq_lens):
        if n:
            _free_before(case, b, max(0, n - window), bs, spare)
    q = torch.randn(len(seq_lens), heads, d, generator=g)
    sinks = torch.randn(heads, generator=g) * 2 if with_sinks else None
    want = torch.zeros(q.shape, dtype=torch.float64)
    for b, n in enumerate(seq_lens):
        if n:
            want[b] = _naive(q[b : b + 1], keys[b], values[b], n - 1, window, sinks)[0]
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    args = (q, case.k_cache, case.v_cache, case.block_tables, lens, SCALE)
    ref = reference.paged_attention_decode(*args, sliding_window=window, sinks=sinks)
    torch.testing.assert_close(ref.double(), want, atol=1e-5, rtol=1e-5)
    dev_args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    got = kernels["decode_attention"].paged_attention_decode(
        *dev_args, sliding_window=window, sinks=None if sinks is None else sinks.to(device),
        num_splits=num_splits, block_n=16,
    )  # fmt: skip
    torch.testing.assert_close(got.cpu().double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize(
    ("window", "num_splits", "block_m"), [(6, 1, 16), (20, 1, 32), (20, 3, 16)]
)
def test_prefill_window_and_sinks(kernels, device, window, num_splits, block_m, with_sinks):
    # (cached prefix, chunk): a whole prompt longer than the window, a chunk after a long
    # prefix, a decode token, a short prompt inside the window, a chunk on a block boundary.
    shapes, bs, heads, kv_heads, d = [(0, 45), (33, 21), (50, 1), (0, 4), (24, 9)], 8, 4, 2, 32
    seq_lens = [p + c for p, c in shapes]
    case, keys, values, spare, g = _windowed_case(seq_lens, window, bs, kv_heads, d, 22)
    for b, (prefix, _) in enumerate(shapes):
        _free_before(case, b, max(0, prefix - window + 1), bs, spare)
    q_lens = [c for _, c in shapes]
    q = torch.randn(sum(q_lens), heads, d, generator=g)
    sinks = torch.randn(heads, generator=g) * 2 if with_sinks else None
    want, at = torch.zeros(q.shape, dtype=torch.float64), 0
    for b, (prefix, chunk) in enumerate(shapes):
        if chunk:
            want[at : at + chunk] = _naive(
                q[at : at + chunk], keys[b], values[b], prefix, window, sinks
            )
        at += chunk
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    args = (q, case.k_cache, case.v_cache, cu, lens, case.block_tables, SCALE, max(q_lens))
    ref = reference.paged_attention_prefill(*args, sliding_window=window, sinks=sinks)
    torch.testing.assert_close(ref.double(), want, atol=1e-5, rtol=1e-5)
    dev_args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    got = kernels["prefill_attention"].paged_attention_prefill(
        *dev_args, sliding_window=window, sinks=None if sinks is None else sinks.to(device),
        block_m=block_m, block_n=16, num_splits=num_splits,
    )  # fmt: skip
    torch.testing.assert_close(got.cpu().double(), want, atol=2e-5, rtol=2e-5)

"""Causal attention of packed chunks over their own keys only: the prefill of fresh prompts.

When every chunk of a step starts at position 0 (no cached prefix, no earlier chunk), attention
needs nothing from the paged cache: the step's own q, k and v, which the layer holds densely
after the qkv projection, are the whole problem. That is the dense attention problem, so torch's
fused kernels run it instead of the paged Triton kernel (`prefill_attention.py`), in one of two
ways:

- **One chunk**: torch SDPA, cuDNN's attention first, flash attention if cuDNN does not take the
  shapes (never the math or memory-efficient kernels). cuDNN builds an execution plan per new
  shape, 64-105 ms on an H200 (first call at 8,000 / 8,001 / 5,003 tokens against 0.8-1.3 ms
  for the next), so the chunk is padded at its end to a length bucket (`bucket_length`: eight
  per octave) and the engine builds every bucket's plan at start-up (`warm_up`). Padding at the
  end is exact: a causal query never sees a key after it, so the real rows' output is the
  unpadded one; the padded rows are zeros and their output is dropped.
- **Several chunks**: one launch of torch's flash attention over the packed chunks
  (`aten::_flash_attention_forward` with cumulative lengths, the kernel behind
  `torch.nn.attention.varlen.varlen_attn`, GQA native, no plan to build): SDPA chunk after chunk
  left the GPU mostly idle (8 x 1,024 tokens: 21-25% of batched SDPA), and cuDNN's ragged
  variant rebuilt its plan on every call (60-90 ms).

Which steps come here at all is `takes_dense_path`, read by the attention layer on the host:
one chunk from `min_dense_chunk` tokens, several only where flash attention beats the paged
kernel (head_dim above `FLASH_VARLEN_MAX_PAGED_HEAD_DIM`). Its docstring has the figures.

No Triton here: the op registry's "triton" backend is the GPU backend. `supported` is the
start-up probe: torch builds without these kernels (CPU-only, ROCm builds without flash
attention) or shapes they do not take answer False, and the engine keeps the paged kernel.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

log = logging.getLogger(__name__)

DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256  # flash attention's largest head size
_SDPA_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]
# (num_heads, num_kv_heads, head_dim, dtype) whose one-chunk attention calls cuDNN's aten op
# directly (`sdpa_causal`): filled by `supported` where that call agreed with the reference.
_CUDNN_DIRECT: set[tuple[int, int, int, torch.dtype]] = set()

# A lone fresh chunk shorter than its minimum keeps the paged kernel (`min_dense_chunk`): this
# one for wide query heads (num_heads * head_dim >= WIDE_QUERY: Llama-3.1-8B's 32 x 128, the
# Qwen3.5-4B hybrid's 16 x 256), the second for narrower ones (Qwen3-0.6B's 16 x 128). H200
# measurements (docs/benchmarks.md, 2026-12-02 sixth session): the in-place cuDNN call against
# the paged kernel, one prompt, paged/dense time: 8B heads 0.95 at 2,048 tokens, 1.17 at 3,072,
# 1.29 at 4,096; hybrid heads 1.03 / 1.39 / 1.55; 0.6B heads 0.96 / 1.07 / 1.06, 1.23 at 5,003,
# 1.32 at 6,144. Engine TTFT, dense on against off, medians of five: the 8B 71.6 against 76.4
# ms at 3,072 tokens and 122.3 against 129.7 at 5,003; the 0.6B, whose eager prefill step waits
# on the host (11.5-27 ms for 1,024 tokens, by machine), lost 1-5 ms up to 4,096 tokens on every
# machine and at 5,003 on two of three, and won at 8,192 in both TTFT calls (34.1 against 36.5,
# 28.6 against 36.9), hence its later minimum; the runner turns narrow heads on only when asked.
MIN_DENSE_CHUNK = 3072
NARROW_HEADS_MIN_DENSE_CHUNK = 6144
WIDE_QUERY = 4096
# Buckets per power of two: a chunk is padded by less than 1/8 of its length, so its attention
# does less than 1.27x the causal FLOPs of the unpadded chunk (1.09x on average over 1,024-8,192
# tokens). Four per octave would allow 1.56x (1.19x on average), as much as cuDNN's whole lead
# over the paged kernel on Qwen3-0.6B heads (82% against 68% of SDPA). Eight cost 13 plans for
# 3,072-8,192 tokens (25 from 1,024), built once at start-up.
BUCKETS_PER_OCTAVE = 8
# Several fresh chunks take flash attention only with heads wider than this (see
# `takes_dense_path`).
FLASH_VARLEN_MAX_PAGED_HEAD_DIM = 128

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def min_dense_chunk(num_heads: int, head_dim: int) -> int:
    """The fewest tokens of a lone fresh chunk that attends densely, for these query heads (per
    rank): `MIN_DENSE_CHUNK` for wide ones, `NARROW_HEADS_MIN_DENSE_CHUNK` below `WIDE_QUERY`."""
    if num_heads * head_dim >= WIDE_QUERY:
        return MIN_DENSE_CHUNK
    return max(MIN_DENSE_CHUNK, NARROW_HEADS_MIN_DENSE_CHUNK)


def takes_dense_path(chunk_lens: tuple[int, ...], num_heads: int, head_dim: int) -> bool:
    """Whether a step of fresh chunks (every one starting at position 0) attends here rather
    than through the paged kernel. Host values only: the layer asks on every prefill step.

    One chunk: from `min_dense_chunk` tokens. One 8,192-token chunk through cuDNN ran at 89% /
    82% / 93% of SDPA on dense tensors (Llama-3.1-8B 32/8 heads, Qwen3-0.6B 16/8, head_dim 128;
    Qwen3.5-4B 16/4, head_dim 256) against the paged kernel's 60% / 68% / 42% (H200, torch 2.11);
    engine TTFT 210 against 230 ms (8B, medians). Shorter chunks win less or lose (the figures
    at `MIN_DENSE_CHUNK`; `benchmarks/dense_crossover.py`).

    Several chunks: only with head_dim above `FLASH_VARLEN_MAX_PAGED_HEAD_DIM`. Flash varlen
    against the paged kernel, % of SDPA: at head_dim 128, 2 x 4,096 tokens 52-55 against 59-61,
    8 x 1,024 51-53 against 50, five mixed lengths 77-82 against 87 (no better, often worse); at
    head_dim 256, 47 against 43, 53 against 40 and 77 against 68."""
    if len(chunk_lens) == 1:
        return chunk_lens[0] >= min_dense_chunk(num_heads, head_dim)
    return head_dim > FLASH_VARLEN_MAX_PAGED_HEAD_DIM


def bucket_length(n: int) -> int:
    """The padded length of a one-chunk step of n tokens: n rounded up to a multiple of
    1/`BUCKETS_PER_OCTAVE` of the largest power of two not above n (1,024, 1,152, ..., 2,048,
    2,304, ...; every length below 8 is its own bucket). Monotone, at least n, and less than
    n * (1 + 1/BUCKETS_PER_OCTAVE)."""
    if n < 1:
        raise ValueError(f"a chunk has at least one token, got {n}")
    step = max(1, (1 << (n.bit_length() - 1)) // BUCKETS_PER_OCTAVE)
    return -(-n // step) * step


def bucket_lengths(max_tokens: int, min_tokens: int | None = None) -> list[int]:
    """Every bucket a one-chunk step of `min_tokens` (default `MIN_DENSE_CHUNK`) to `max_tokens`
    tokens pads to, ascending (none when max_tokens is below the minimum): the plans `warm_up`
    builds."""
    lengths = []
    n = MIN_DENSE_CHUNK if min_tokens is None else min_tokens
    while n <= max_tokens:
        lengths.append(bucket_length(n))
        n = lengths[-1] + 1
    return lengths


def varlen_causal_attention(q, k, v, cu_seqlens_q, chunk_lens, scale, max_seqlen_q, padded_rows=0):
    if len(chunk_lens) == 1:
        return padded_chunk_attention(q, k, v, scale, sdpa_causal, padded_rows)
    return flash_varlen(q, k, v, cu_seqlens_q, scale, max_seqlen_q)


def padded_chunk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    attend: Attend,
    padded_rows: int = 0,
) -> torch.Tensor:
    """Causal attention of one chunk (q `[n, num_heads, head_dim]`, k, v `[n, num_kv_heads,
    head_dim]`, any strides with a contiguous last dim) run by `attend` on `[1, heads, rows,
    head_dim]` views padded at the end to `rows = bucket_length(n)` with zeros; returns the
    output's first n rows as `[n, num_heads, head_dim]`. `attend(q, k, v, scale)` is causal
    attention of such views returning `[1, num_heads, rows, head_dim]` (`sdpa_causal` on a GPU;
    a torch reference in the CPU tests).

    `padded_rows`: the caller's promise that q, k and v are views into a buffer that already
    holds that many rows with zeros past the chunk (the qkv projection allocates it so for a
    step that comes here, `forward_context.dense_rows`); when it is the bucket and the storage
    does hold those rows, the padded views are taken in place and nothing is copied. Otherwise
    the rows are copied: views into one row buffer (the qkv projection's output, q's heads
    first) as one copy of the whole rows into a buffer of the same row layout, anything else
    as three copies into `[rows, num_heads + 2 * num_kv_heads, head_dim]`. Either way a bucket
    reaches `attend` with the sizes and strides `warm_up` gives it for that layout (the key of
    cuDNN's plan cache), so the warm-up builds exactly the plans these calls use. An eager
    prefill step of a small model waits on this host code once a layer, so each view is one
    `as_strided` (`prefill_dense_bench.py --host-cost`)."""
    n = q.shape[0]
    rows = bucket_length(n)
    if (
        padded_rows == rows
        and _holds_rows(q, rows)
        and _holds_rows(k, rows)
        and _holds_rows(v, rows)
    ):
        qt, kt, vt = (_heads_first(t, rows, t, t.storage_offset()) for t in (q, k, v))
    elif (width := _row_width(q, k, v)) is not None:
        buf = torch.empty(rows * width, dtype=q.dtype, device=q.device)
        base = q.storage_offset()
        buf[: n * width].view(n, width).copy_(q.as_strided((n, width), (width, 1), base))
        buf[n * width :].zero_()
        qt, kt, vt = (_heads_first(t, rows, buf, t.storage_offset() - base) for t in (q, k, v))
    else:
        num_heads, num_kv_heads = q.shape[1], k.shape[1]
        qkv = torch.empty(
            rows, num_heads + 2 * num_kv_heads, q.shape[2], dtype=q.dtype, device=q.device
        )
        qkv[n:].zero_()
        padded = _split_heads(qkv, num_heads, num_kv_heads)
        for dst, src in zip(padded, (q, k, v), strict=True):
            dst[:n].copy_(src)
        qt, kt, vt = (_heads_first(t, rows, t, t.storage_offset()) for t in padded)
    o = attend(qt, kt, vt, scale)
    return o.as_strided((n, o.shape[1], o.shape[3]), (o.stride(2), o.stride(1), o.stride(3)))


def _heads_first(t: torch.Tensor, rows: int, base: torch.Tensor, offset: int) -> torch.Tensor:
    """t (`[n, heads, head_dim]`) as a `[1, heads, rows, head_dim]` view of `base`'s storage at
    `offset`, with t's strides."""
    rs, hs = t.stride(0), t.stride(1)
    return base.as_strided((1, t.shape[1], rows, t.shape[2]), (rows * rs, hs, rs, 1), offset)


def _holds_rows(t: torch.Tensor, rows: int) -> bool:
    """Whether t's storage reaches `rows` rows of t's strides."""
    last = t.storage_offset() + (rows - 1) * t.stride(0) + _row_span(t)
    return rows > 0 and last < t.untyped_storage().nbytes() // t.element_size()


def _row_span(t: torch.Tensor) -> int:
    """How far t's last element of a row lies past the row's first (elements)."""
    return sum(
        (size - 1) * stride for size, stride in zip(t.shape[1:], t.stride()[1:], strict=True)
    )


def _row_width(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int | None:
    """The row width (elements) when q, k and v are views into the rows of one buffer (the
    same storage and row stride, each head row-contiguous with q's first head at a row's
    start and k, v within the row): then copying q's whole rows copies all three. Else None."""
    width = q.stride(0)
    base = q.storage_offset()
    same = all(
        t.untyped_storage().data_ptr() == q.untyped_storage().data_ptr() and t.stride(0) == width
        for t in (k, v)
    )
    if not same or base + q.shape[0] * width > q.untyped_storage().nbytes() // q.element_size():
        return None
    for t in (q, k, v):
        off = t.storage_offset() - base
        if off < 0 or off + _row_span(t) >= width:
            return None
    return width


def _split_heads(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    kv_end = num_heads + num_kv_heads
    return qkv[:, :num_heads], qkv[:, num_heads:kv_end], qkv[:, kv_end:]


def qkv_views(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, q_gate: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k and v as the attention layer takes them from a `[T, width]` qkv projection: q's
    heads first (each followed by its output gate with `q_gate`, gated attention), then k's,
    then v's."""
    q_width = (2 if q_gate else 1) * head_dim
    q_end = num_heads * q_width
    kv_width = num_kv_heads * head_dim
    q = qkv[:, :q_end].view(-1, num_heads, q_width)[..., :head_dim]
    k = qkv[:, q_end : q_end + kv_width].view(-1, num_kv_heads, head_dim)
    v = qkv[:, q_end + kv_width :].view(-1, num_kv_heads, head_dim)
    return q, k, v


def sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal SDPA (cuDNN, else flash) of one chunk's `[1, heads, tokens, head_dim]` views;
    returns `[1, num_heads, tokens, head_dim]`. For heads whose direct cuDNN call `supported`
    verified (`_CUDNN_DIRECT`), cuDNN's aten op is called without SDPA's backend choice around
    it: the same kernel and plan cache for less host time a call."""
    direct = (q.shape[1], k.shape[1], q.shape[3], q.dtype) in _CUDNN_DIRECT
    return _causal(q, k, v, scale, direct)


def sdpa_causal_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """`sdpa_causal` of `[tokens, heads, head_dim]` tensors, unpadded, returning the same layout:
    the baseline the tests and benchmarks compare the padded path with."""
    o = sdpa_causal(*(t.transpose(0, 1)[None] for t in (q, k, v)), scale)
    return o[0].transpose(0, 1)


def _causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, cudnn_direct: bool
) -> torch.Tensor:
    if cudnn_direct:  # no softmax statistics kept, as SDPA without autograd: the same plan key
        return torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, False, 0.0, True, False, scale=scale
        )[0]
    with sdpa_kernel(_SDPA_BACKENDS):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=True
        )


def flash_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    max_seqlen_q: int,
) -> torch.Tensor:
    """One flash-attention launch over the packed chunks."""
    out, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_q, max_seqlen_q, max_seqlen_q,
        0.0,  # dropout
        True,  # causal, with query i of a chunk aligned to key i: every chunk starts at 0
        False,  # return_debug_mask
        scale=scale,
    )  # fmt: skip
    return out


def warm_up(
    device: torch.device,
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_tokens: int,
    q_gate: bool = False,
) -> list[int]:
    """Run the one-chunk path once at every bucket from these heads' `min_dense_chunk` up to
    `max_tokens` (`bucket_lengths`), so cuDNN builds each plan now and no request pays one;
    returns those lengths. Each call attends over
    zero views of a qkv projection's rows laid out as the layer's (`qkv_views`, `q_gate` for
    gated attention), which is how `padded_chunk_attention` hands a step's bucket over, and,
    like a step's, needs no gradient, so its plan-cache key (sizes, strides, dtype, device,
    causal, whether softmax statistics are kept) is the one a step's chunk of that bucket will
    look up. Run it on the thread that runs the steps: torch keeps cuDNN's attention plans per
    thread. Returns once the last call has finished on the device."""
    lengths = bucket_lengths(max_tokens, min_dense_chunk(num_heads, head_dim))
    width = ((2 if q_gate else 1) * num_heads + 2 * num_kv_heads) * head_dim
    for rows in lengths:
        qkv = torch.zeros(rows, width, dtype=dtype, device=device)
        q, k, v = qkv_views(qkv, num_heads, num_kv_heads, head_dim, q_gate)
        padded_chunk_attention(q, k, v, head_dim**-0.5, sdpa_causal, rows)
        del qkv
    torch.cuda.synchronize(device)
    return lengths


def supported(
    device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> bool:
    """Whether `varlen_causal_attention` runs, and agrees with the torch reference, for these
    heads on this device: both of its ways (one 42-token chunk alone, padded to 44 rows; chunks
    of 37 and 5 in one launch), GQA as given, on strided views, through the real calls. Any error
    or disagreement answers False (logged)."""
    from atom_kernels import reference

    if device.type != "cuda" or dtype not in DTYPES or head_dim > MAX_HEAD_DIM:
        return False
    # Strided views into one fused tensor, q's heads spaced as gated attention's are: the
    # layouts the layers pass.
    gen = torch.Generator(device=device).manual_seed(0)
    qkv = torch.randn(42, (2 * num_heads + 2 * num_kv_heads) * head_dim, generator=gen,
                      device=device).to(dtype)  # fmt: skip
    q, k, v = qkv_views(qkv, num_heads, num_kv_heads, head_dim, q_gate=True)
    scale = head_dim**-0.5
    err = 0.0
    try:
        for offsets, lens in (([0, 42], (42,)), ([0, 37, 42], (37, 5))):
            cu = torch.tensor(offsets, dtype=torch.int32, device=device)
            got = varlen_causal_attention(q, k, v, cu, lens, scale, max(lens))
            want = reference.varlen_causal_attention(q, k, v, cu, lens, scale, max(lens))
            err = max(err, (got.float() - want.float()).abs().max().item())
    except Exception as exc:  # no flash attention in this torch build, or not for these shapes
        log.info(
            "dense prefill attention unavailable (%s: %s): fresh prompts take the paged kernel",
            type(exc).__name__, str(exc)[:200],
        )  # fmt: skip
        return False
    if not err < 0.05:
        log.warning(
            "dense prefill attention disagrees with the reference (max error %.3g): fresh "
            "prompts take the paged kernel", err,
        )  # fmt: skip
        return False
    _try_cudnn_direct(q, k, v, scale)
    return True


def _try_cudnn_direct(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> None:
    """Add these heads to `_CUDNN_DIRECT` when cuDNN's aten op, called directly, attends a
    padded chunk of them as the reference does (else SDPA keeps choosing the backend)."""
    from atom_kernels import reference

    key = (q.shape[1], k.shape[1], q.shape[2], q.dtype)
    try:
        got = padded_chunk_attention(
            q, k, v, scale, lambda *qkv_scale: _causal(*qkv_scale, cudnn_direct=True)
        )
        want = reference.causal_attention(q, k, v, scale, 0)
        err = (got.float() - want.float()).abs().max().item()
    except Exception as exc:  # no cuDNN attention in this build, or not for these heads
        log.info("cuDNN attention not called directly (%s: %s)", type(exc).__name__, str(exc)[:200])
        return
    if err < 0.05:
        _CUDNN_DIRECT.add(key)
    else:
        log.info("cuDNN attention called directly disagrees (max error %.3g): SDPA chooses", err)

"""Causal attention of packed chunks over their own keys only: the prefill of fresh prompts.

When every chunk of a step starts at position 0 (no cached prefix, no earlier chunk), attention
needs nothing from the paged cache: the step's own q, k and v, which the layer holds densely
after the qkv projection, are the whole problem. That is the dense attention problem, so torch's
fused kernels run it instead of the paged Triton kernel (`prefill_attention.py`, about 60% of
SDPA's throughput on an H200), in one of two ways:

- **One chunk**: torch SDPA on the chunk's [1, heads, tokens, head_dim] view, cuDNN's attention
  first, flash attention if cuDNN does not take the shapes (never the math or memory-efficient
  kernels). On an H200 with torch 2.11, cuDNN is what SDPA picks for dense tensors and runs at
  1.8x the flash kernel. cuDNN builds an execution plan per new shape (tens of ms or more,
  reported elsewhere), so every new prompt length pays one: not yet measured here.
- **Several chunks**: one launch of torch's flash attention over the packed chunks
  (`aten::_flash_attention_forward` with cumulative lengths, the kernel behind
  `torch.nn.attention.varlen.varlen_attn`, GQA native): SDPA chunk after chunk left the GPU
  mostly idle (8 x 1,024 tokens: 21-25% of batched SDPA), and cuDNN's ragged variant rebuilt
  its plan on every call (60-90 ms).

No Triton here: the op registry's "triton" backend is the GPU backend. `supported` is the
start-up probe: torch builds without these kernels (CPU-only, ROCm builds without flash
attention) or shapes they do not take answer False, and the engine keeps the paged kernel.
"""

from __future__ import annotations

import logging

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

log = logging.getLogger(__name__)

DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256  # flash attention's largest head size
_SDPA_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]


def varlen_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    chunk_lens: tuple[int, ...],
    scale: float,
    max_seqlen_q: int,
) -> torch.Tensor:
    if len(chunk_lens) == 1:
        return sdpa_per_chunk(q, k, v, chunk_lens, scale)
    return flash_varlen(q, k, v, cu_seqlens_q, scale, max_seqlen_q)


def sdpa_per_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_lens: tuple[int, ...], scale: float
) -> torch.Tensor:
    """SDPA (cuDNN, else flash) on each chunk's [1, heads, tokens, head_dim] view, in turn."""
    outs = []
    lo = 0
    with sdpa_kernel(_SDPA_BACKENDS):
        for n in chunk_lens:
            qs, ks, vs = (t[lo : lo + n].transpose(0, 1)[None] for t in (q, k, v))
            o = torch.nn.functional.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True
            )
            outs.append(o[0].transpose(0, 1))
            lo += n
    return outs[0] if len(outs) == 1 else torch.cat(outs)


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


def supported(
    device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> bool:
    """Whether `varlen_causal_attention` runs, and agrees with the torch reference, for these
    heads on this device: both of its ways (one 42-token chunk alone; chunks of 37 and 5 in one
    launch), GQA as given, on strided views, through the real calls. Any error or disagreement answers False
    (logged)."""
    from atom_kernels import reference

    if device.type != "cuda" or dtype not in DTYPES or head_dim > MAX_HEAD_DIM:
        return False
    # Strided views into one fused tensor, q's heads spaced as gated attention's are: the
    # layouts the layers pass.
    gen = torch.Generator(device=device).manual_seed(0)
    qkv = torch.randn(42, (2 * num_heads + 2 * num_kv_heads) * head_dim, generator=gen,
                      device=device).to(dtype)  # fmt: skip
    q_end, kv = 2 * num_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_end].view(42, num_heads, 2 * head_dim)[..., :head_dim]
    k = qkv[:, q_end : q_end + kv].view(42, num_kv_heads, head_dim)
    v = qkv[:, q_end + kv :].view(42, num_kv_heads, head_dim)
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
    return True

"""The one interface the runtime calls for its custom kernels.

Each op is declared once, here: a function whose signature and docstring are the op's
contract and whose body checks the arguments at the boundary, decorated with `@op`, which
names the Triton implementation (`"module.function"` inside `atom_kernels`) and the argument
whose device decides the backend. The torch implementation is the function of the same name
in `atom_kernels.reference`. Both implementations take exactly the op's parameters (names and
defaults; `tests/kernels/test_op_registry.py` pins that), so adding a kernel is one `@op`
declaration here plus its reference and its Triton body.

Every op runs the Triton kernel when its tensors are on a GPU (CUDA or ROCm) and Triton
imports, and the torch reference otherwise. The environment variable
`ATOM_KERNEL_BACKEND=torch|triton` forces one backend for every op; it is read once at import
(and again by `refresh_backend()`), never per call. Forcing `triton` on CPU tensors only
works under `TRITON_INTERPRET=1` (that is how the CPU tests run).

The Triton modules are imported on first use, so a CPU-only process never pays for
importing Triton.

KV cache layout (per layer): `k_cache`, `v_cache` are
`[num_blocks, block_size, num_kv_heads, head_dim]` with a contiguous last dim; a token's
slot is `block_id * block_size + offset`. The cache's dtype is the model's or an FP8 format
(float8_e4m3fn, or float8_e4m3fnuz on MI300): every op that writes or reads the cache takes
`k_scale` and `v_scale`, the per-tensor dequantization scales of an FP8 cache (a float or a
one-element fp32 tensor, 1.0 by default; a tensor is read on the device, so a captured CUDA
graph follows its value), ignored for any other cache dtype.

FP8 weights (`fp8_formats`: e4m3 data, fp32 dequantization scales per tensor, per output row
or in blocks given by `weight_block_size`) go through the batch-1 GEMV ops (weight-only: x stays
in its dtype) and `fp8_linear` (W8A8 for many rows), with the activation quantizers beside them.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
from collections.abc import Callable
from typing import Any

import torch

from atom_kernels import envs, reference
from atom_kernels.fp8_formats import is_fp8, scale_layout

BACKEND_ENV = envs.KERNEL_BACKEND.name
_BACKENDS = ("torch", "triton")

_forced_backend: str | None = None
_triton_installed: bool = False


class Op:
    """One kernel op as declared: the boundary check (the declared function), the torch
    reference and the Triton implementation (imported on first use)."""

    def __init__(self, check: Callable[..., None], triton: str | None, on: str) -> None:
        self.name = check.__name__
        self.check = check
        self.reference: Callable[..., Any] = getattr(reference, self.name)
        self.triton_path = triton
        self.on = on
        self.triton_fn: Callable[..., Any] | None = None

    def triton_impl(self) -> Callable[..., Any]:
        if self.triton_fn is None:
            if self.triton_path is None:
                raise RuntimeError(f"{self.name} has no Triton implementation")
            module, _, name = self.triton_path.rpartition(".")
            self.triton_fn = getattr(importlib.import_module(f"atom_kernels.{module}"), name)
        return self.triton_fn


OPS: dict[str, Op] = {}


def op(triton: str | None, on: str) -> Callable[[Callable[..., None]], Callable[..., Any]]:
    """Declare an op: `triton` is `"module.function"` in `atom_kernels` (None: torch on every
    device), `on` the argument whose device picks the backend. The declared function's body
    checks the arguments; the returned callable checks, then runs one implementation."""

    def declare(check: Callable[..., None]) -> Callable[..., Any]:
        record = Op(check, triton, on)
        index = list(inspect.signature(check).parameters).index(on)

        # A plain closure, not a class's __call__: this runs for every op call of an eager
        # forward, so it stays as cheap as the hand-written dispatch it replaced.
        @functools.wraps(check)
        def dispatch(*args: Any, **kwargs: Any) -> Any:
            check(*args, **kwargs)
            if record.triton_path is not None and _use_triton(
                args[index] if len(args) > index else kwargs[on]
            ):
                return (record.triton_fn or record.triton_impl())(*args, **kwargs)
            return record.reference(*args, **kwargs)

        dispatch.op = record  # type: ignore[attr-defined]
        OPS[record.name] = record
        return dispatch

    return declare


def refresh_backend() -> None:
    """Re-read `ATOM_KERNEL_BACKEND` and forget the loaded Triton launchers (for tests)."""
    global _forced_backend, _triton_installed
    value = envs.KERNEL_BACKEND.value().lower() or None
    if value is not None and value not in _BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={value!r}: expected one of {', '.join(_BACKENDS)}")
    _forced_backend = value
    _triton_installed = importlib.util.find_spec("triton") is not None
    for declared in OPS.values():
        declared.triton_fn = None


def backend_for(t: torch.Tensor) -> str:
    """The backend an op on tensor `t` dispatches to: "triton" or "torch"."""
    return "triton" if _use_triton(t) else "torch"


def _use_triton(t: torch.Tensor) -> bool:
    if _forced_backend is not None:
        return _forced_backend == "triton"
    return t.is_cuda and _triton_installed  # is_cuda is also true on ROCm builds


def _check_cache(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | float = 1.0,
    v_scale: torch.Tensor | float = 1.0,
) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache/v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache is {k_cache.dtype}, v_cache {v_cache.dtype}: one cache dtype")
    if is_fp8(k_cache):
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            _check_scalar_scale(name, s, k_cache.device)


def _check_scalar_scale(name: str, scale: torch.Tensor | float, device: torch.device) -> None:
    """A per-tensor scale: a float, or a one-element fp32 tensor on the data's device."""
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or scale.dtype != torch.float32 or scale.device != device:
            raise ValueError(
                f"{name} must be a float or a one-element fp32 tensor on {device}, got "
                f"{scale.dtype} {tuple(scale.shape)} on {scale.device}"
            )
    elif not isinstance(scale, (int, float)):
        raise ValueError(f"{name} must be a float or a one-element fp32 tensor, got {type(scale)}")


def _check_window(sliding_window: int, sinks: torch.Tensor | None, num_heads: int) -> None:
    if sliding_window < 0:
        raise ValueError(f"sliding_window must be >= 0 (0: none), got {sliding_window}")
    if sinks is not None and (tuple(sinks.shape) != (num_heads,) or not sinks.is_contiguous()):
        raise ValueError(f"sinks must be a contiguous [{num_heads}], got {tuple(sinks.shape)}")


@op(triton="kv_cache.store_kvcache", on="key")
def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | float = 1.0,
    v_scale: torch.Tensor | float = 1.0,
) -> None:
    """Write `key[i]`/`value[i]` (`[num_tokens, num_kv_heads, head_dim]`) into cache slot
    `slot_mapping[i]` (int64); slot -1 marks a padding token and is skipped. In place. An FP8
    cache stores `clamp(key / k_scale)` rounded to nearest (likewise v)."""
    _check_cache(k_cache, v_cache, k_scale, v_scale)
    if key.shape != value.shape or key.shape[1:] != k_cache.shape[2:]:
        raise ValueError(
            f"key/value {tuple(key.shape)}/{tuple(value.shape)} do not match the cache's "
            f"[*, {k_cache.shape[2]}, {k_cache.shape[3]}]"
        )
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} != [{key.shape[0]}]")


@op(triton="decode_attention.paged_attention_decode", on="q")
def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    k_scale: torch.Tensor | float = 1.0,
    v_scale: torch.Tensor | float = 1.0,
    sliding_window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged KV cache.

    q: `[B, num_heads, head_dim]`, the token at position `context_lens[b] - 1` whose K/V are
    already stored. block_tables: int32 `[B, max_blocks_per_seq]` (entries past the used
    blocks are ignored). context_lens: int32 `[B]`; 0 gives a zero output row. Returns
    `[B, num_heads, head_dim]` (written into `out` when given). CUDA-graph capturable on
    the Triton path: no host syncs, launch sizes depend on shapes only. An FP8 cache holds K / k_scale
    and V / v_scale: the attention is over K and V.

    sliding_window (> 0): the token sees only the last `sliding_window` positions (its own
    included), and block-table entries wholly before them are never read (they may be freed).
    sinks: fp32 `[num_heads]`, a per-head logit that joins each softmax's denominator and
    contributes no value (GPT-OSS's attention sinks).
    """
    _check_cache(k_cache, v_cache, k_scale, v_scale)
    _check_query(q)
    _check_window(sliding_window, sinks, q.shape[1])
    if q.dim() != 3 or q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2]:
        raise ValueError(
            f"q {tuple(q.shape)} must be [B, num_heads, {k_cache.shape[3]}] with num_heads "
            f"a multiple of num_kv_heads={k_cache.shape[2]}"
        )


@op(triton="prefill_attention.paged_attention_prefill", on="q")
def paged_attention_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_seqlen_q: int,
    out: torch.Tensor | None = None,
    *,
    k_scale: torch.Tensor | float = 1.0,
    v_scale: torch.Tensor | float = 1.0,
    sliding_window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention for a batch of variable-length query chunks packed back to back.

    q: `[T, num_heads, head_dim]`; chunk b is `q[cu_seqlens_q[b]:cu_seqlens_q[b+1]]`.
    seq_lens[b]: tokens in the cache for sequence b including this chunk (already stored).
    Query i of chunk b sits at position `seq_lens[b] - q_len_b + i` and attends to cache
    positions `0..` that position. A chunk of length 1 is a decode step. max_seqlen_q is
    an upper bound on the chunk lengths (it sizes the launch). Returns `[T, num_heads,
    head_dim]` (written into `out` when given). An FP8 cache, `sliding_window` and `sinks`: as
    for `paged_attention_decode` (a query at position p sees `p - sliding_window + 1..p`).
    """
    _check_cache(k_cache, v_cache, k_scale, v_scale)
    _check_query(q)
    _check_window(sliding_window, sinks, q.shape[1])
    if q.dim() != 3 or q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2]:
        raise ValueError(
            f"q {tuple(q.shape)} must be [T, num_heads, {k_cache.shape[3]}] with num_heads "
            f"a multiple of num_kv_heads={k_cache.shape[2]}"
        )
    if cu_seqlens_q.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError(
            f"cu_seqlens_q has {cu_seqlens_q.shape[0]} entries; expected len(seq_lens) + 1"
        )


def _check_query(q: torch.Tensor) -> None:
    if is_fp8(q):
        raise ValueError("q must be in the model's dtype (only the cache may be FP8)")


@op(triton="varlen_attention.varlen_causal_attention", on="q")
def varlen_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    chunk_lens: tuple[int, ...],
    scale: float,
    max_seqlen_q: int,
    padded_rows: int = 0,
) -> torch.Tensor:
    """Causal attention of packed chunks that all start at position 0, over their own keys only
    (fresh prompts: no cached prefix, no earlier chunk), so no cache is read.

    q: `[T, num_heads, head_dim]`, k, v: `[T, num_kv_heads, head_dim]` (num_heads a multiple of
    num_kv_heads), each with a contiguous last dim (views into the qkv projection are fine);
    chunk b is rows `cu_seqlens_q[b]:cu_seqlens_q[b+1]` of all three, its lengths also given
    on the host as `chunk_lens` (summing to T). Query i of a chunk sees keys 0..i of the same
    chunk. max_seqlen_q is the longest chunk. Returns `[T, num_heads, head_dim]`. On a GPU one
    chunk runs through cuDNN's SDPA padded to its length bucket, several through one launch of
    torch's flash attention (`varlen_attention`; `supported` says whether it runs there).
    `padded_rows`: q, k and v are views into a buffer of that many rows, zeros past T (the qkv
    projection's output for such a step, `forward_context.dense_rows`), so the lone chunk's
    padding needs no copy; 0 (or a buffer that does not hold them): the rows are copied."""
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must be [T, heads, "
            "head_dim] with one head_dim"
        )
    if q.shape[0] != k.shape[0] or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)}: same tokens, num_heads a multiple of "
            "num_kv_heads"
        )
    if q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("q, k and v need a contiguous last dim")
    if cu_seqlens_q.shape[0] != len(chunk_lens) + 1 or sum(chunk_lens) != q.shape[0]:
        raise ValueError(
            f"{len(chunk_lens)} chunks of {sum(chunk_lens)} tokens for {q.shape[0]} query rows "
            f"and {cu_seqlens_q.shape[0]} cu_seqlens_q entries"
        )


def _check_latent_cache(kv_cache: torch.Tensor, rope: int) -> None:
    if kv_cache.dim() != 3 or kv_cache.stride(2) != 1 or kv_cache.shape[2] <= rope:
        raise ValueError(
            f"kv_cache must be [num_blocks, block_size, latent + {rope}] with a contiguous last "
            f"dim, got {tuple(kv_cache.shape)}"
        )


@op(triton="mla_attention.mla_rope_store_", on="q_rope")
def mla_rope_store_(
    q_rope: torch.Tensor,
    kv_a: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_norm_weight: torch.Tensor,
    eps: float,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    is_neox: bool = False,
) -> None:
    """Multi-head latent attention's cache write, in one pass per token.

    q_rope: `[T, num_heads, rope]` (a strided view of the query's rope channels), rotated in
    place. kv_a: `[T, latent + rope]` (the kv_a projection: latent, then the shared rope key;
    a strided view is fine). For each token with `slot_mapping[t] >= 0` the cache row at that
    slot becomes `[rms_norm(latent) * kv_norm_weight | rotated rope key]`; kv_a is not changed.
    kv_cache: `[num_blocks, block_size, latent + rope]`, one row per token (not per head).
    cos_sin_cache as for `rotary_embedding_` with rotary_dim == rope; `is_neox=False` rotates
    interleaved pairs (DeepSeek's layout), True rotates halves."""
    if q_rope.dim() != 3 or q_rope.shape[2] != cos_sin_cache.shape[-1] or q_rope.shape[2] % 2:
        raise ValueError(
            f"q_rope {tuple(q_rope.shape)} must be [T, heads, rope] with an even rope equal to "
            f"the cos_sin_cache's rotary dim {cos_sin_cache.shape[-1]}"
        )
    _check_latent_cache(kv_cache, q_rope.shape[2])
    if kv_a.dim() != 2 or kv_a.shape != (q_rope.shape[0], kv_cache.shape[2]) or kv_a.stride(1) != 1:
        raise ValueError(
            f"kv_a {tuple(kv_a.shape)} must be [{q_rope.shape[0]}, {kv_cache.shape[2]}] with a "
            "contiguous last dim"
        )
    if kv_norm_weight.shape != (kv_cache.shape[2] - q_rope.shape[2],):
        raise ValueError(f"kv_norm_weight {tuple(kv_norm_weight.shape)} must match the latent")
    if slot_mapping.shape != (q_rope.shape[0],) or positions.shape != (q_rope.shape[0],):
        raise ValueError("slot_mapping and positions need one entry per token")


@op(triton="mla_attention.mla_decode_attention", on="q_latent")
def mla_decode_attention(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Absorbed multi-head latent attention: one query row per sequence over its latent cache.

    Row b's head h has the query `[q_latent[b, h] | q_rope[b, h]]` (`[B, H, latent]`,
    `[B, H, rope]`, contiguous last dims, any other strides) and attends over the first
    `context_lens[b]` rows of the cache (`[num_blocks, block_size, latent + rope]`) through
    `block_tables[b]` (int32 `[B, max_blocks]`): scores `q . row * scale`, values the rows'
    first `latent` channels. context_lens int32 `[B]`; 0 gives a zero row. Returns `[B, H,
    latent]` (into `out` when given). CUDA-graph capturable on the Triton path."""
    rope = q_rope.shape[-1]
    _check_latent_cache(kv_cache, rope)
    latent = kv_cache.shape[2] - rope
    b, h = q_latent.shape[:2]
    if q_latent.shape != (b, h, latent) or q_rope.shape != (b, h, rope):
        raise ValueError(
            f"q_latent {tuple(q_latent.shape)} and q_rope {tuple(q_rope.shape)} must be [B, H, "
            f"{latent}] and [B, H, {rope}] for a cache of width {kv_cache.shape[2]}"
        )
    if q_latent.stride(2) != 1 or q_rope.stride(2) != 1:
        raise ValueError("q_latent and q_rope need a contiguous last dim")
    if block_tables.dim() != 2 or block_tables.shape[0] != b or context_lens.shape != (b,):
        raise ValueError(f"block_tables [{b}, max_blocks] and context_lens [{b}] expected")


@op(triton="mla_attention.mla_prefill_attention", on="q")
def mla_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_lens: tuple[int, ...],
    kv_lens: tuple[int, ...],
    scale: float,
) -> torch.Tensor:
    """Up-projected multi-head latent attention of long prompt chunks: causal attention with
    per-head keys and values expanded from the latents.

    q: `[T, H, qk_dim]` (chunks packed back to back), k: `[S, H, qk_dim]`, v: `[S, H, v_dim]`
    (each chunk's whole context packed back to back: cached prefix, earlier chunks and the
    chunk itself); host lengths `q_lens`, `kv_lens` per chunk, q_len <= kv_len. Query i of a
    chunk sits at position kv_len - q_len + i and sees keys 0..that position. Returns `[T, H,
    v_dim]`. On a GPU: torch SDPA per chunk (no Triton kernel yet)."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or q.shape[1:] != k.shape[1:]:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [*, H, qk_dim] alike, v [S, H, *]"
        )
    if v.shape[:2] != k.shape[:2] or len(q_lens) != len(kv_lens):
        raise ValueError(f"v {tuple(v.shape)} must match k's rows and heads, one kv_len a chunk")
    if sum(q_lens) != q.shape[0] or sum(kv_lens) != k.shape[0]:
        raise ValueError(
            f"chunks of {sum(q_lens)}/{sum(kv_lens)} rows for q/k of {q.shape[0]}/{k.shape[0]}"
        )
    if any(ql > kl for ql, kl in zip(q_lens, kv_lens, strict=True)):
        raise ValueError("a chunk has more query tokens than keys")


@op(triton="norm.rms_norm", on="x")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of `x` (`[T, H]`), computed in fp32; returns x.dtype."""
    if x.shape[-1] != weight.shape[0]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} disagree")


@op(triton="norm.fused_add_rms_norm", on="x")
def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`residual = x + residual`; `out = rms_norm(residual)`; returns `(out, residual)`.

    Both backends overwrite `residual` in place with the sum (rounded to its dtype) and
    return that same tensor; `out` is a new tensor; `x` is left untouched.
    """
    if x.shape != residual.shape or x.shape[-1] != weight.shape[0]:
        raise ValueError(
            f"x {tuple(x.shape)}, residual {tuple(residual.shape)}, weight "
            f"{tuple(weight.shape)} disagree"
        )


@op(triton="rotary.rotary_embedding_", on="q")
def rotary_embedding_(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> None:
    """Apply rotary position embedding to q (`[T, num_heads, head_dim]`) and k
    (`[T, num_kv_heads, head_dim]`) in place; both may be strided views (e.g. slices of a
    fused qkv output). positions: int64 `[T]`. cos_sin_cache: fp32 `[max_position,
    rotary_dim]`, cos in the first half of the last dim, sin in the second; channels past
    rotary_dim are left alone. `is_neox=True` rotates halves (HF Llama/Qwen),
    False rotates interleaved pairs (GPT-J)."""
    rotary_dim = cos_sin_cache.shape[-1]
    if rotary_dim % 2 or rotary_dim > q.shape[-1] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"rotary_dim {rotary_dim} must be even and <= head_dim; q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}"
        )


def _check_rope_cache(
    cos_sin_cache, k_cache, v_cache, num_kv_heads: int, head_dim: int, partial: bool = False
) -> None:
    rotary_dim = cos_sin_cache.shape[-1]
    if partial and (rotary_dim % 2 or not 0 < rotary_dim <= head_dim):
        raise ValueError(f"cos_sin_cache rotary dim {rotary_dim} must be even and <= {head_dim}")
    if not partial and (rotary_dim != head_dim or head_dim % 2):
        raise ValueError(f"cos_sin_cache rotary dim {rotary_dim} must equal head_dim")
    _check_cache(k_cache, v_cache)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(f"cache {tuple(k_cache.shape)} does not hold {num_kv_heads} x {head_dim}")


@op(triton="fused.qk_norm_rope_store_", on="qkv")
def qk_norm_rope_store_(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_gate: bool = False,
    *,
    k_scale: torch.Tensor | float = 1.0,
    v_scale: torch.Tensor | float = 1.0,
) -> None:
    """Prepare attention inputs in one pass over a fused qkv projection output.

    qkv: `[T, (num_heads + 2 * num_kv_heads) * head_dim]`, rows laid out [q heads | k heads |
    v heads], last dim contiguous. With `q_gate` (Qwen3.5/Next gated attention) each q head is
    followed by its output gate: `[T, (2 * num_heads + 2 * num_kv_heads) * head_dim]`, rows
    [query 0, gate 0, query 1, gate 1, ... | k heads | v heads]; the gates are left alone.
    Per token: RMSNorm of every q and k head (when both norm weights are given, `[head_dim]`
    each; Qwen3), neox rotary of the first rotary_dim channels of q and k (cos_sin_cache as for
    `rotary_embedding_`, rotary_dim = `cos_sin_cache.shape[-1]` <= head_dim: partial rotary
    leaves the rest as normed), both written back into `qkv` in place; then k (rotated) and v
    are stored into the paged cache at `slot_mapping` (-1: skip). The result equals `rms_norm`
    + `rotary_embedding_` + `store_kvcache` (with k_scale, v_scale) applied in turn."""
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("q_norm_weight and k_norm_weight must be given together")
    width = ((2 if q_gate else 1) * num_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width or qkv.stride(1) != 1:
        raise ValueError(f"qkv {tuple(qkv.shape)} must be [T, {width}] with a contiguous last dim")
    _check_rope_cache(cos_sin_cache, k_cache, v_cache, num_kv_heads, head_dim, partial=True)
    _check_cache(k_cache, v_cache, k_scale, v_scale)


@op(triton="fused.sigmoid_gate_mul", on="x")
def sigmoid_gate_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The output gate of gated attention: `x * sigmoid(gate)` in fp32, returned in x's dtype as
    a new contiguous `[T, H, D]` tensor. x, gate `[T, H, D]` with a contiguous last dim (gate is
    typically the strided gate half of `qk_norm_rope_store_(..., q_gate=True)`'s qkv)."""
    if x.dim() != 3 or gate.shape != x.shape:
        raise ValueError(
            f"x and gate must both be [T, H, D], got {tuple(x.shape)}, {tuple(gate.shape)}"
        )
    if x.stride(2) != 1 or gate.stride(2) != 1:
        raise ValueError("x and gate need a contiguous last dim")


@op(triton="fused.silu_and_mul", on="x")
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation over a fused [gate | up] projection: x `[T, 2w]` -> `[T, w]`."""
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(1) != 1:
        raise ValueError(f"x {tuple(x.shape)} must be [T, 2w] with a contiguous last dim")


@op(triton="gemv.linear_small_m", on="x")
def linear_small_m(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    act: str | None = None,
    weight_scale: torch.Tensor | None = None,
    weight_block_size: tuple[int, int] | list[int] | None = None,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for a single row x (`[1, K]`, contiguous) and a row-major
    weight (`[N, K]`): the batch-1 decode projection, a pure weight read. Triton GEMV on a GPU
    (bandwidth-bound, CUDA-graph capturable: the launch shape depends on shapes only);
    `F.linear` elsewhere. Returns `[1, N]` in x's dtype.

    `act="silu_mul"`: the weight is SwiGLU's gate_up, [gate; up] rows (N even), and the
    result is `silu_and_mul(F.linear(x, weight, bias))`, `[1, N / 2]`, the activation applied
    in the GEMV's epilogue.

    An FP8 weight comes with `weight_scale` (fp32: `[]`/`[1]` per tensor, `[N]`/`[N, 1]` per
    row, or `[ceil(N/bn), ceil(K/bk)]` with `weight_block_size=(bn, bk)`): the product is with
    the dequantized weight, in fp32, x not quantized (on a GPU the kernel reads the FP8 bytes).
    Fused weights with block scales need each part to start on a block (every row's scale row
    is row // bn)."""
    _check_small_m(x, weight, bias, act, weight_scale, weight_block_size)


def _check_fp8_weight(weight, weight_scale, weight_block_size) -> None:
    if not is_fp8(weight):
        if weight_scale is not None or weight_block_size is not None:
            raise ValueError(f"weight_scale and weight_block_size go with an FP8 weight, not "
                             f"{weight.dtype}")  # fmt: skip
        return
    if weight_scale is None:
        raise ValueError(f"an FP8 weight ({weight.dtype}) needs its weight_scale")
    if weight_scale.dtype != torch.float32 or weight_scale.device != weight.device:
        raise ValueError(
            f"weight_scale must be fp32 on {weight.device}, got {weight_scale.dtype} on "
            f"{weight_scale.device}"
        )
    layout = scale_layout(weight.shape, weight_scale, weight_block_size)
    if layout != "tensor" and not weight_scale.is_contiguous():
        raise ValueError("weight_scale must be contiguous")


def _check_small_m(x, weight, bias, act, weight_scale=None, weight_block_size=None) -> None:
    if act not in (None, "silu_mul"):
        raise ValueError(f"act={act!r}: expected None or 'silu_mul'")
    if weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(
            f"weight {tuple(weight.shape)} must be a 2-D [N, K] matrix with contiguous rows"
        )
    n, k = weight.shape
    if x.dim() != 2 or x.shape != (1, k) or not x.is_contiguous():
        raise ValueError(f"x {tuple(x.shape)} must be one contiguous row [1, {k}]")
    if act == "silu_mul" and n % 2:
        raise ValueError(f"act='silu_mul' needs [gate; up] weight rows; got an odd N={n}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n or not bias.is_contiguous()):
        raise ValueError(f"bias {tuple(bias.shape)} must be a contiguous [{n}]")
    _check_fp8_weight(weight, weight_scale, weight_block_size)


@op(triton="gemv_rows.linear_few_rows", on="x")
def linear_few_rows(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    act: str | None = None,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for a few rows x (`[M, K]`, 2 <= M <= 16, contiguous rows)
    and a row-major weight (`[N, K]`): a speculative verify step's projection at batch 1 (its
    last token and drafts), a weight read shared by every row. Triton on a GPU
    (`gemv_rows.py`: one read of the weight for all rows; CUDA-graph capturable); `F.linear`
    elsewhere. `act="silu_mul"`: SwiGLU over [gate; up] rows, `[M, N / 2]`."""
    if act not in (None, "silu_mul"):
        raise ValueError(f"act={act!r}: expected None or 'silu_mul'")
    if weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(
            f"weight {tuple(weight.shape)} must be a 2-D [N, K] matrix with contiguous rows"
        )
    n, k = weight.shape
    if x.dim() != 2 or x.shape[1] != k or not 2 <= x.shape[0] <= 16 or x.stride(1) != 1:
        raise ValueError(f"x {tuple(x.shape)} must be [M, {k}], 2 <= M <= 16, contiguous rows")
    if act == "silu_mul" and n % 2:
        raise ValueError(f"act='silu_mul' needs [gate; up] weight rows; got an odd N={n}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n or not bias.is_contiguous()):
        raise ValueError(f"bias {tuple(bias.shape)} must be a contiguous [{n}]")


@op(triton="gemv.linear_rope_store_small_m", on="x")
def linear_rope_store_small_m(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    weight_scale: torch.Tensor | None = None,
    weight_block_size: tuple[int, int] | list[int] | None = None,
    k_scale: torch.Tensor | float = 1.0,
    v_scale: torch.Tensor | float = 1.0,
) -> torch.Tensor:
    """The qkv projection of one token and its attention preparation in one pass:
    `F.linear(x, weight, bias)` (x `[1, K]`, weight `[(H + 2 KV) * D, K]`), then rotary of the
    q and k heads and the store of k and v into the paged cache at `slot_mapping[0]` — what
    `linear_small_m` followed by `qk_norm_rope_store_` gives, with QK-norm when
    `q_norm_weight` and `k_norm_weight` (each `[D]`) are given. Returns the qkv row
    `[1, (H + 2 KV) * D]` with q and k (normed and) rotated. On a GPU one Triton GEMV launch
    whose programs each own dimension pairs (i, i + D/2) of a head (with QK-norm: whole heads,
    D a power of two), rotated in the epilogue. FP8 weights as `linear_small_m`; an FP8 cache
    stores k / k_scale and v / v_scale."""
    _check_small_m(x, weight, bias, None, weight_scale, weight_block_size)
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("q_norm_weight and k_norm_weight: give both (QK-norm) or neither")
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if w is not None and (w.shape != (head_dim,) or not w.is_contiguous()):
            raise ValueError(f"{name} {tuple(w.shape)} must be a contiguous [{head_dim}]")
    if q_norm_weight is not None and head_dim & (head_dim - 1):
        raise ValueError(f"QK-norm in the projection needs a power-of-two head_dim, got {head_dim}")
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if weight.shape[0] != width or head_dim % 2:
        raise ValueError(
            f"weight {tuple(weight.shape)} must have (num_heads + 2 * num_kv_heads) * head_dim "
            f"= {width} rows, head_dim even"
        )
    if positions.shape != (1,) or slot_mapping.shape != (1,):
        raise ValueError("positions and slot_mapping must hold one token each")
    _check_rope_cache(cos_sin_cache, k_cache, v_cache, num_kv_heads, head_dim)
    _check_cache(k_cache, v_cache, k_scale, v_scale)


@op(triton="gemv.rms_norm_linear_small_m", on="x")
def rms_norm_linear_small_m(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    act: str | None = None,
    weight_scale: torch.Tensor | None = None,
    weight_block_size: tuple[int, int] | list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm (after adding `residual`, when given) then `linear_small_m` (with `act`), for one
    row x (`[1, K]`): returns `(linear(norm(x + residual)), x + residual)`, or
    `(linear(norm(x)), x)` without a residual, the sum rounded to x's dtype as
    `fused_add_rms_norm` rounds it. Unlike that op the residual is not updated in place. On a
    GPU the norm runs inside the Triton GEMV (one launch); elsewhere the reference norm and
    `F.linear`. FP8 weights as `linear_small_m`."""
    n, k = weight.shape
    _check_small_m(x, weight, bias, act, weight_scale, weight_block_size)
    if residual is not None and (residual.shape != x.shape or not residual.is_contiguous()):
        raise ValueError(f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
    if norm_weight.shape != (k,):
        raise ValueError(f"norm_weight {tuple(norm_weight.shape)} must be [{k}]")


@op(triton="gemv.rms_norm_linear_rope_store_small_m", on="x")
def rms_norm_linear_rope_store_small_m(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    qk_eps: float = 1e-6,
    *,
    weight_scale: torch.Tensor | None = None,
    weight_block_size: tuple[int, int] | list[int] | None = None,
    k_scale: torch.Tensor | float = 1.0,
    v_scale: torch.Tensor | float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder layer's input RMSNorm (after adding `residual`, when given), then
    `linear_rope_store_small_m`: returns `(qkv, x + residual)`, or `(qkv, x)` without a
    residual, as `rms_norm_linear_small_m` does. On a GPU one Triton GEMV launch: the norm in
    its prologue, QK-norm, rotary and the cache store in its epilogue."""
    fp8 = dict(weight_scale=weight_scale, weight_block_size=weight_block_size)
    rms_norm_linear_small_m.op.check(x, residual, norm_weight, eps, weight, bias, **fp8)
    linear_rope_store_small_m.op.check(
        x, weight, bias, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, num_heads,
        num_kv_heads, head_dim, q_norm_weight, k_norm_weight, qk_eps, **fp8, k_scale=k_scale,
        v_scale=v_scale,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# FP8: activation quantizers and the W8A8 GEMM for many rows. Scales are dequantization
# multipliers (real = fp8 * scale); layouts in `atom_kernels.fp8_formats`.
# ---------------------------------------------------------------------------------------------


def _check_activation(x: torch.Tensor, fp8_dtype: torch.dtype) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x {tuple(x.shape)} must be [M, K] with a contiguous last dim")
    if is_fp8(x) or not x.is_floating_point():
        raise ValueError(f"x must be a floating-point activation, got {x.dtype}")
    if not is_fp8(fp8_dtype):
        raise ValueError(f"fp8_dtype must be float8_e4m3fn or float8_e4m3fnuz, got {fp8_dtype}")


@op(triton="fp8_quant.per_tensor_quant_fp8", on="x")
def per_tensor_quant_fp8(
    x: torch.Tensor, fp8_dtype: torch.dtype, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[M, K]` quantized with one scale: the given static one (`[1]` fp32, a checkpoint's
    `input_scale`), or `max(amax(|x|), 1e-12) / dynamic_quant_max(fp8_dtype)` computed on the
    device. Returns (q `[M, K]` in fp8_dtype, scale `[1]` fp32)."""
    _check_activation(x, fp8_dtype)
    if scale is not None:
        _check_scalar_scale("scale", scale, x.device)


@op(triton="fp8_quant.per_token_quant_fp8", on="x")
def per_token_quant_fp8(
    x: torch.Tensor, fp8_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token quantization: row m of x `[M, K]` scaled by its own
    `max(amax, 1e-12) / dynamic_quant_max`. Returns (q `[M, K]`, scale `[M, 1]` fp32)."""
    _check_activation(x, fp8_dtype)


@op(triton="fp8_quant.per_token_group_quant_fp8", on="x")
def per_token_group_quant_fp8(
    x: torch.Tensor, group_size: int, fp8_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token-group quantization (the activation side of block-scaled weights): each
    run of `group_size` columns of a row (the last one may be shorter) scaled by its own amax.
    Returns (q `[M, K]`, scale `[M, ceil(K / group_size)]` fp32, row-major)."""
    _check_activation(x, fp8_dtype)
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")


@op(triton="fp8_gemm.fp8_linear", on="x")
def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    input_scale: torch.Tensor | None = None,
    weight_block_size: tuple[int, int] | list[int] | None = None,
) -> torch.Tensor:
    """`F.linear` of x `[..., K]` (half precision) with an FP8 weight `[N, K]` as W8A8: x is
    quantized to the weight's FP8 format, per token group of `weight_block_size[1]` columns for
    block scales, else per token (dynamic) or with the static per-tensor `input_scale`, and the
    product of the two quantized operands is taken in fp32 with both scales, plus bias, returned
    in x's dtype `[..., N]`. The reference computes exactly that with dequantized operands; on a
    GPU block weights take a Triton GEMM, the others `torch._scaled_mm` (`atom_kernels.fp8_gemm`).
    """
    if weight.dim() != 2 or not is_fp8(weight) or weight.stride(1) != 1:
        raise ValueError(
            f"weight must be an FP8 [N, K] matrix with contiguous rows, got {weight.dtype} "
            f"{tuple(weight.shape)}"
        )
    if x.shape[-1] != weight.shape[1] or is_fp8(x):
        raise ValueError(f"x {tuple(x.shape)} must be [..., {weight.shape[1]}] in half precision")
    _check_fp8_weight(weight, weight_scale, weight_block_size)
    if input_scale is not None:
        if weight_block_size is not None:
            raise ValueError("a static input_scale goes with per-tensor or per-channel weights")
        _check_scalar_scale("input_scale", input_scale, x.device)
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias {tuple(bias.shape)} must be [{weight.shape[0]}]")


# ---------------------------------------------------------------------------------------------
# Hybrid (linear-attention) models. Shapes: T tokens of the batch packed back to back, B
# sequences, S slots in the state pool. query_start_loc int32 [B+1] (0 first); slot_ids int32
# [B] (-1: padding row, nothing read or written, zero output); has_initial_state bool [B]
# (False: start from zero state whatever the slot holds).
# ---------------------------------------------------------------------------------------------


def _check_rows(query_start_loc, slot_ids, has_initial_state, device) -> None:
    if query_start_loc.dim() != 1 or query_start_loc.dtype != torch.int32:
        raise ValueError(
            f"query_start_loc must be int32 [B+1], got {query_start_loc.dtype} "
            f"{tuple(query_start_loc.shape)}"
        )
    b = query_start_loc.shape[0] - 1
    if b < 0:
        raise ValueError("query_start_loc must hold at least one entry (0)")
    if slot_ids.dtype != torch.int32 or tuple(slot_ids.shape) != (b,):
        raise ValueError(
            f"slot_ids must be int32 [{b}], got {slot_ids.dtype} {tuple(slot_ids.shape)}"
        )
    if has_initial_state.dtype != torch.bool or tuple(has_initial_state.shape) != (b,):
        raise ValueError(
            f"has_initial_state must be bool [{b}], got {has_initial_state.dtype} "
            f"{tuple(has_initial_state.shape)}"
        )
    for name, t in (
        ("query_start_loc", query_start_loc),
        ("slot_ids", slot_ids),
        ("has_initial_state", has_initial_state),
    ):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, the inputs on {device}")


def _check_conv(x, weight, bias, conv_state, activation) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [T, D], got {tuple(x.shape)}")
    d = x.shape[1]
    if weight.dim() != 2 or weight.shape[0] != d or weight.shape[1] < 2:
        raise ValueError(f"weight must be [{d}, W] with W >= 2, got {tuple(weight.shape)}")
    width = weight.shape[1]
    if bias is not None and tuple(bias.shape) != (d,):
        raise ValueError(f"bias must be [{d}], got {tuple(bias.shape)}")
    if conv_state.dim() != 3 or tuple(conv_state.shape[1:]) != (d, width - 1):
        raise ValueError(f"conv_state must be [S, {d}, {width - 1}], got {tuple(conv_state.shape)}")
    if activation not in (None, "silu"):
        raise ValueError(f"activation={activation!r}: expected 'silu' or None")


def _check_gdn(q, k, v, g, beta, state) -> None:
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(
            f"q and k must both be [T, Hk, Dk], got {tuple(q.shape)}, {tuple(k.shape)}"
        )
    t, hk, dk = q.shape
    if v.dim() != 3 or v.shape[0] != t or v.shape[1] % hk:
        raise ValueError(
            f"v must be [{t}, Hv, Dv] with Hv a multiple of {hk}, got {tuple(v.shape)}"
        )
    hv, dv = v.shape[1], v.shape[2]
    if tuple(g.shape) != (t, hv) or g.dtype != torch.float32:
        raise ValueError(f"g must be fp32 [{t}, {hv}], got {g.dtype} {tuple(g.shape)}")
    if tuple(beta.shape) != (t, hv):
        raise ValueError(f"beta must be [{t}, {hv}], got {tuple(beta.shape)}")
    if state.dim() != 4 or tuple(state.shape[1:]) != (hv, dk, dv):
        raise ValueError(f"state must be [S, {hv}, {dk}, {dv}], got {tuple(state.shape)}")


@op(triton="conv1d.causal_conv1d_", on="x")
def causal_conv1d_(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    slot_ids: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Depthwise causal conv1d over packed sequences, with a per-slot rolling input state.

    x `[T, D]`; weight `[D, W]`; bias `[D]` or None; conv_state `[S, D, W-1]` holds the last
    W-1 inputs of each slot's sequence, oldest first. Sequence b (tokens `query_start_loc[b]:
    query_start_loc[b+1]`) is convolved over `[conv_state[slot] (or zeros) ; x_b]`, and the
    slot is overwritten in place with the last W-1 inputs of that concatenation (so a
    sequence shorter than W-1 keeps part of the old state). Returns y `[T, D]` in x's dtype,
    `act(conv + bias)` (activation "silu" or None); padding rows (slot -1) give zeros."""
    _check_conv(x, weight, bias, conv_state, activation)
    _check_rows(query_start_loc, slot_ids, has_initial_state, x.device)


@op(triton="gdn.gated_delta_rule_", on="q")
def gated_delta_rule_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    query_start_loc: torch.Tensor,
    slot_ids: torch.Tensor,
    has_initial_state: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention) over packed sequences.

    q, k `[T, Hk, Dk]`; v `[T, Hv, Dv]`, Hv a multiple of Hk (k head h serves v heads
    `h * Hv/Hk ...`); g `[T, Hv]` fp32 log decay (<= 0); beta `[T, Hv]` in (0, 1); state
    `[S, Hv, Dk, Dv]` updated in place for every real row's slot. Per head, in fp32: q and k
    L2-normalised over Dk when `use_qk_l2norm` (eps 1e-6), q scaled by `scale`, then per token
    `S = S * exp(g); S = S + k^T (beta * (v - k S)); o = q S`. Returns o `[T, Hv, Dv]` in v's
    dtype (zeros on padding rows)."""
    _check_gdn(q, k, v, g, beta, state)
    _check_rows(query_start_loc, slot_ids, has_initial_state, q.device)


def _check_verify_slots(slots, query_start_loc, device) -> None:
    b = query_start_loc.shape[0] - 1
    if slots.dim() != 2 or slots.dtype != torch.int32 or slots.shape[0] != b:
        raise ValueError(f"slots must be int32 [{b}, W], got {slots.dtype} {tuple(slots.shape)}")
    if not slots.is_contiguous():
        raise ValueError("slots must be contiguous")
    if slots.device != device:
        raise ValueError(f"slots is on {slots.device}, the inputs on {device}")


@op(triton="conv1d.causal_conv1d_verify_", on="x")
def causal_conv1d_verify_(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """`causal_conv1d_` for a speculative verify step, keeping the window after every token.

    slots int32 `[B, W]`: sequence b reads its window from slot `slots[b, 0]` (unless
    `has_initial_state[b]` is False) and the window after its token j (the last W-1 inputs of
    `[state ; x_b[: j + 1]]`) is written to slot `slots[b, j]` for j < W where that is >= 0. A
    row with `slots[b, 0] < 0` is not one of these sequences: zero output, nothing read or
    written (so one batch can run prompt chunks through `causal_conv1d_` and verified rows
    through this, each with the other's rows masked). Returns y `[T, D]` like
    `causal_conv1d_`."""
    _check_conv(x, weight, bias, conv_state, activation)
    _check_verify_slots(slots, query_start_loc, x.device)
    _check_rows(query_start_loc, slots[:, 0].contiguous(), has_initial_state, x.device)


@op(triton="gdn.gated_delta_rule_verify_", on="q")
def gated_delta_rule_verify_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    query_start_loc: torch.Tensor,
    slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """`gated_delta_rule_` for a speculative verify step, keeping the state after every token.

    slots int32 `[B, W]`: sequence b starts from slot `slots[b, 0]` (zeros when
    `has_initial_state[b]` is False), runs its tokens one by one and leaves the state after
    token j in slot `slots[b, j]` for j < W where that is >= 0 (slot 0 after the first token
    is the usual choice: the reads happen first). A row with `slots[b, 0] < 0` is not one of
    these sequences (zero output, no state touched). Returns o `[T, Hv, Dv]` like
    `gated_delta_rule_`."""
    _check_gdn(q, k, v, g, beta, state)
    _check_verify_slots(slots, query_start_loc, q.device)
    _check_rows(query_start_loc, slots[:, 0].contiguous(), has_initial_state, q.device)


@op(triton="norm.gated_rms_norm", on="x")
def gated_rms_norm(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """`rms_norm(x) * weight * silu(z)` over the last dim (Qwen3-Next's RMSNormGated, norm
    before gate): x, z `[N, D]`, weight `[D]`; fp32 math, returned in x's dtype."""
    if x.dim() != 2 or z.shape != x.shape:
        raise ValueError(f"x and z must both be [N, D], got {tuple(x.shape)}, {tuple(z.shape)}")
    if tuple(weight.shape) != (x.shape[1],):
        raise ValueError(f"weight must be [{x.shape[1]}], got {tuple(weight.shape)}")


@op(triton="gdn.gdn_gating", on="a")
def gdn_gating(
    a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated DeltaNet's per-token gates from the in_proj outputs a, b `[T, Hv]` (strided views of
    the projection are fine; last dim contiguous) and the per-head a_log, dt_bias `[Hv]`:
    returns `(g, beta)`, both fp32 contiguous `[T, Hv]`, with `g = -exp(a_log) * softplus(a +
    dt_bias)` (the log decay fed to `gated_delta_rule_`) and `beta = sigmoid(b)`, in fp32."""
    if a.dim() != 2 or b.shape != a.shape:
        raise ValueError(f"a and b must both be [T, Hv], got {tuple(a.shape)}, {tuple(b.shape)}")
    if a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError("a and b need a contiguous last dim")
    hv = a.shape[1]
    if tuple(a_log.shape) != (hv,) or tuple(dt_bias.shape) != (hv,):
        raise ValueError(
            f"a_log and dt_bias must be [{hv}], got {tuple(a_log.shape)}, {tuple(dt_bias.shape)}"
        )


@op(triton="gdn_decode.gated_delta_net_decode_", on="proj")
def gated_delta_net_decode_(
    proj: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    slot_ids: torch.Tensor,
    has_initial_state: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One decode token of a Gated DeltaNet layer per row, from its in_proj output to the input
    of out_proj: what `causal_conv1d_` (silu, no bias) + `gdn_gating` + `gated_delta_rule_`
    (with the q/k L2 norm) + `gated_rms_norm` compute for rows of one token each.

    proj `[B, conv_dim + Hv*Dv + 2*Hv]`: row b is sequence b's one token, laid out [q (Hk*Dk) |
    k (Hk*Dk) | v (Hv*Dv) | z (Hv*Dv) | b (Hv) | a (Hv)], conv_dim = 2*Hk*Dk + Hv*Dv; a strided
    view of the projection is fine (last dim contiguous). conv_weight `[conv_dim, W]`;
    conv_state `[S, conv_dim, W-1]` and ssm_state `[S, Hv, Dk, Dv]` (fp32, or 16-bit: only
    what is stored is rounded) updated in place at each real row's slot (Hk, Dk, Hv, Dv come
    from these shapes). a_log, dt_bias `[Hv]`; norm_weight
    `[Dv]` (the gated norm's plain weight). slot_ids int32 `[B]` (-1: a padding row: zero
    output, no state read or written), has_initial_state bool `[B]` (False: zero conv window
    and zero recurrent state, whatever the slot holds). Math in fp32, with the chain's
    roundings: the conv output and the recurrence output rounded to proj's dtype before use.
    Returns `[B, Hv*Dv]` in proj's dtype. On a GPU one Triton launch with no host sync and a
    grid from shapes (CUDA-graph capturable); a batch that fills the GPU takes the wide kernel
    (`gdn_decode_wide.py`)."""
    if proj.dim() != 2 or proj.stride(1) != 1:
        raise ValueError(f"proj {tuple(proj.shape)} must be [B, width] with a contiguous last dim")
    if ssm_state.dim() != 4:
        raise ValueError(f"ssm_state must be [S, Hv, Dk, Dv], got {tuple(ssm_state.shape)}")
    hv, dk, dv = ssm_state.shape[1:]
    if conv_weight.dim() != 2 or conv_weight.shape[1] < 2:
        raise ValueError(
            f"conv_weight must be [conv_dim, W] with W >= 2, got {tuple(conv_weight.shape)}"
        )
    conv_dim, width = conv_weight.shape
    key_size = (conv_dim - hv * dv) // 2
    if key_size <= 0 or 2 * key_size + hv * dv != conv_dim or key_size % dk:
        raise ValueError(
            f"conv_weight's {conv_dim} channels are not 2*Hk*{dk} + {hv}*{dv} for any Hk"
        )
    hk = key_size // dk
    if hv % hk:
        raise ValueError(f"Hv={hv} must be a multiple of Hk={hk}")
    if proj.shape[1] != conv_dim + hv * dv + 2 * hv:
        raise ValueError(f"proj width {proj.shape[1]} != {conv_dim} + {hv * dv} + {2 * hv}")
    if conv_state.dim() != 3 or tuple(conv_state.shape[1:]) != (conv_dim, width - 1):
        raise ValueError(
            f"conv_state must be [S, {conv_dim}, {width - 1}], got {tuple(conv_state.shape)}"
        )
    if tuple(a_log.shape) != (hv,) or tuple(dt_bias.shape) != (hv,):
        raise ValueError(f"a_log and dt_bias must be [{hv}]")
    if tuple(norm_weight.shape) != (dv,):
        raise ValueError(f"norm_weight must be [{dv}], got {tuple(norm_weight.shape)}")
    b = proj.shape[0]
    if slot_ids.dtype != torch.int32 or tuple(slot_ids.shape) != (b,):
        raise ValueError(
            f"slot_ids must be int32 [{b}], got {slot_ids.dtype} {tuple(slot_ids.shape)}"
        )
    if has_initial_state.dtype != torch.bool or tuple(has_initial_state.shape) != (b,):
        raise ValueError(
            f"has_initial_state must be bool [{b}], got {has_initial_state.dtype} "
            f"{tuple(has_initial_state.shape)}"
        )
    for name, t in (("slot_ids", slot_ids), ("has_initial_state", has_initial_state)):
        if t.device != proj.device:
            raise ValueError(f"{name} is on {t.device}, proj on {proj.device}")


@op(triton="moe.moe_topk", on="router_logits")
def moe_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, shared_expert: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router: softmax over the E experts in fp32 (`router_logits [T, E]`), the top_k
    experts, their weights rescaled to sum 1 when `renormalize`. Returns (topk_weights fp32
    `[T, top_k]`, topk_ids int32 `[T, top_k]`).

    shared_expert: `router_logits` is `[T, E + 1]`, its last column the shared expert's gate
    logit; the results gain a column top_k holding expert E (the shared expert, stacked after
    the routed ones) with weight sigmoid(logit). Triton on a GPU: one program per token."""
    if router_logits.dim() != 2 or router_logits.stride(1) != 1:
        raise ValueError(
            f"router_logits must be [T, E] with a contiguous last dim, got "
            f"{tuple(router_logits.shape)}"
        )
    experts = router_logits.shape[1] - (1 if shared_expert else 0)
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k={top_k} must be in [1, {experts}]")


@op(triton="moe.fused_moe", on="x")
def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: str = "silu",
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
) -> torch.Tensor:
    """Sparse MoE with gated experts: `y[t] = sum_j topk_weights[t, j] * (w2[e] @ act(w13[e,
    :I] @ x[t] + b13[e, :I], w13[e, I:] @ x[t] + b13[e, I:]) + b2[e])`, e = topk_ids[t, j].

    x `[T, H]`; w13 `[E, 2I, H]` (gate rows then up rows); w2 `[E, H, I]`; topk_weights fp32
    `[T, K]`; topk_ids int32 `[T, K]` in [0, E). Optional biases w13_bias `[E, 2I]` and
    w2_bias `[E, H]` (GPT-OSS; None: no bias). `activation`: "silu" is SwiGLU, `silu(gate) *
    up`; "swiglu_clamped" is GPT-OSS's, gate clamped above at `swiglu_limit`, up to
    [-limit, limit], then `gate * sigmoid(swiglu_alpha * gate) * (up + 1)`. Returns `[T, H]`
    in x's dtype. On a GPU: tokens sorted by expert and two grouped Triton GEMMs (no loop over
    experts)."""
    if x.dim() != 2:
        raise ValueError(f"x must be [T, H], got {tuple(x.shape)}")
    t, h = x.shape
    if w13.dim() != 3 or w13.shape[2] != h or w13.shape[1] % 2:
        raise ValueError(f"w13 must be [E, 2I, {h}], got {tuple(w13.shape)}")
    e, inter = w13.shape[0], w13.shape[1] // 2
    if tuple(w2.shape) != (e, h, inter):
        raise ValueError(f"w2 must be [{e}, {h}, {inter}], got {tuple(w2.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t or topk_ids.dtype != torch.int32:
        raise ValueError(
            f"topk_ids must be int32 [{t}, K], got {topk_ids.dtype} {tuple(topk_ids.shape)}"
        )
    if topk_weights.shape != topk_ids.shape or topk_weights.dtype != torch.float32:
        raise ValueError(
            f"topk_weights must be fp32 {tuple(topk_ids.shape)}, got {topk_weights.dtype} "
            f"{tuple(topk_weights.shape)}"
        )
    for name, bias, shape in (("w13_bias", w13_bias, (e, 2 * inter)), ("w2_bias", w2_bias, (e, h))):
        if bias is not None and (tuple(bias.shape) != shape or not bias.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous {list(shape)}, got {tuple(bias.shape)}")
    if activation not in ("silu", "swiglu_clamped"):
        raise ValueError(f"activation={activation!r}: expected 'silu' or 'swiglu_clamped'")


# ---------------------------------------------------------------------------------------------
# State checkpoints: byte copies between pools.
# ---------------------------------------------------------------------------------------------


@op(triton="state_copy.state_copy_", on="table")
def state_copy_(
    pools: list[torch.Tensor], table: torch.Tensor, unit_bytes: int, max_units: int
) -> None:
    """Copy byte ranges within and between pools in one launch, as an affine unit table says.

    pools: 1-D uint8 tensors on one device (views of a KV pool, a state-slot pool, ...).
    table: int64 `[R, 7]` on that device, rows `(src_pool, src_offset, src_stride, dst_pool,
    dst_offset, dst_stride, num_units)` in bytes: unit i of a row copies `unit_bytes` bytes from
    `pools[src_pool][src_offset + i * src_stride:]` to `pools[dst_pool][dst_offset + i *
    dst_stride:]`. Build it with `atom_kernels.copy_table.state_copy_table`, which checks
    bounds, alignment (offsets and strides multiples of the widest of 8/4/2/1 bytes dividing
    unit_bytes) and that no destination overlaps another unit or a source. max_units: the
    launch size, at least the table's total units (a bound from shapes keeps a CUDA graph
    valid; units past it are not copied). Triton: one program per unit, no host sync."""
    if not pools:
        raise ValueError("pools must hold at least one tensor")
    device = pools[0].device
    for i, p in enumerate(pools):
        if p.dtype != torch.uint8 or p.dim() != 1 or not p.is_contiguous() or p.device != device:
            raise ValueError(
                f"pools[{i}] must be a contiguous 1-D uint8 tensor on {device}, got {p.dtype} "
                f"{tuple(p.shape)} on {p.device}"
            )
    if table.dtype != torch.int64 or table.dim() != 2 or table.shape[1] != 7:
        raise ValueError(f"table must be int64 [R, 7], got {table.dtype} {tuple(table.shape)}")
    if table.device != device:
        raise ValueError(f"table is on {table.device}, the pools on {device}")
    if unit_bytes <= 0 or max_units < 0:
        raise ValueError(f"unit_bytes ({unit_bytes}) must be > 0 and max_units ({max_units}) >= 0")


refresh_backend()

"""Fresh prompts' dense prefill path, on CPU: the length buckets a lone chunk is padded to and
the exactness of that padding, which attention path a step's metadata and chunks pick, when the
runner turns the path on (when asked, where the probe passes; never on CPU) and warms its plans,
the metadata the runner builds for each kind of step, and the engine's output with the dense path
forced on (its op runs the torch reference on CPU) against the paged path. On a GPU the path
runs torch's SDPA or flash attention (tests/kernels/test_triton_kernels_gpu.py,
test_gpu_engine.py)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from atom_kernels import ops, reference, varlen_attention
from atom_kernels.varlen_attention import (
    MIN_DENSE_CHUNK,
    NARROW_HEADS_MIN_DENSE_CHUNK,
    bucket_length,
    bucket_lengths,
    padded_chunk_attention,
    takes_dense_path,
)
from atom_runtime import LLM, SamplingParams
from atom_runtime.layers.attention import PagedAttention
from atom_runtime.layers.forward_context import (
    AttentionMetadata,
    fresh_chunk_lengths,
    get_attention_metadata,
    set_attention_metadata,
)
from atom_runtime.worker.model_runner import DENSE_PREFILL_ENV, ModelRunner
from tests.hf_reference import random_prompts


def test_bucket_lengths_round_up_by_less_than_an_eighth():
    """Every length's bucket is at least the length, never smaller than a shorter length's, and
    (from the dense path's minimum on) less than 1.125x it; the buckets from 1,024 tokens are
    eight per octave."""
    lengths = range(1, 40_000)
    buckets = [bucket_length(n) for n in lengths]
    assert all(b >= n for n, b in zip(lengths, buckets, strict=True))
    assert buckets == sorted(buckets)
    assert all(b < 1.125 * n for n, b in zip(lengths, buckets, strict=True) if n >= MIN_DENSE_CHUNK)
    assert [bucket_length(n) for n in (1024, 1025, 1152, 1153, 2047, 2048, 2049, 5003, 8001)] == [
        1024, 1152, 1152, 1280, 2048, 2048, 2304, 5120, 8192,
    ]  # fmt: skip
    with pytest.raises(ValueError, match="at least one token"):
        bucket_length(0)


@pytest.mark.parametrize(
    ("budget", "least", "count"),
    [(1023, 1024, 0), (1024, 1024, 1), (5000, 1024, 19), (8192, 1024, 25), (32768, 1024, 41),
     (8192, MIN_DENSE_CHUNK, 13), (3071, MIN_DENSE_CHUNK, 0), (8192, 6144, 5)],
)  # fmt: skip
def test_the_warmed_buckets_cover_every_chunk_the_budget_allows(budget, least, count):
    """`bucket_lengths(budget, least)`: eight plans an octave, and every lone chunk from the
    minimum to the budget pads to one of them (so none builds a plan while serving)."""
    warmed = bucket_lengths(budget, least)
    assert len(warmed) == count
    assert warmed == sorted(set(warmed))
    assert {bucket_length(n) for n in range(least, budget + 1)} == set(warmed)


def _qkv_views(tokens: int, heads: int, kv_heads: int, dim: int, seed: int):
    """q (strided past output gates, as gated attention holds it), k and v as views into one
    fused tensor, fp32."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (2 * heads + 2 * kv_heads) * dim, generator=g)
    q_end, kv = 2 * heads * dim, kv_heads * dim
    q = qkv[:, :q_end].view(tokens, heads, 2 * dim)[..., :dim]
    k = qkv[:, q_end : q_end + kv].view(tokens, kv_heads, dim)
    v = qkv[:, q_end + kv :].view(tokens, kv_heads, dim)
    return q, k, v


def _dense_from(monkeypatch, tokens: int) -> None:
    """A lone fresh chunk of any heads attends densely from `tokens` tokens."""
    monkeypatch.setattr(varlen_attention, "MIN_DENSE_CHUNK", tokens)
    monkeypatch.setattr(varlen_attention, "NARROW_HEADS_MIN_DENSE_CHUNK", tokens)


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """A `[1, heads, rows, head_dim]` view handed to `attend` as `[rows, heads, head_dim]`."""
    return t[0].transpose(0, 1)


def _reference_attend(qt, kt, vt, scale):
    """`attend` by the torch reference: `[1, heads, rows, head_dim]` in and out."""
    o = reference.causal_attention(_as_rows(qt), _as_rows(kt), _as_rows(vt), scale, 0)
    return o.transpose(0, 1)[None]


@pytest.mark.parametrize("n", [45, 1100, 1152])
def test_padding_a_chunk_at_its_end_is_exact_for_its_rows(n):
    """The one-chunk path pads q/k/v with zero rows at the end up to the bucket and attends over
    that: each real row's output is the unpadded chunk's (a causal query never sees a later key),
    checked with the torch reference as the attention (GQA group 3, strided q). A chunk already
    at a bucket length gets no padding."""
    q, k, v = _qkv_views(n, 6, 2, 16, seed=n)
    seen = []

    def attend(qt, kt, vt, scale):
        seen.append(tuple(_as_rows(t).clone() for t in (qt, kt, vt)))
        return _reference_attend(qt, kt, vt, scale)

    got = padded_chunk_attention(q, k, v, 0.25, attend)
    qp, kp, vp = seen[0]
    rows = bucket_length(n)
    assert [t.shape[0] for t in (qp, kp, vp)] == [rows] * 3
    for padded, real in ((qp, q), (kp, k), (vp, v)):
        assert torch.equal(padded[:n], real)
        assert not padded[n:].any()
    assert got.shape == (n, 6, 16)
    torch.testing.assert_close(got, reference.causal_attention(q, k, v, 0.25, 0))


@pytest.mark.parametrize("q_gate", [False, True])
def test_the_warm_up_reaches_attention_with_every_steps_plan_key(monkeypatch, q_gate):
    """cuDNN keys its plans by the tensors' sizes, strides and dtype: the warm-up's call for a
    bucket presents exactly what a step's chunk padded to that bucket does, for the layer's qkv
    layout (gated attention's q strided past its gates, or not), whether the projection padded
    its output (`padded_rows`) or the rows are copied, so after the warm-up no chunk within the
    budget meets a new key."""
    keys = []

    def record(q, k, v, scale):
        keys.append(tuple((t.shape, t.stride(), t.dtype) for t in (q, k, v)))
        return torch.zeros_like(q)

    monkeypatch.setattr(varlen_attention, "sdpa_causal", record)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    _dense_from(monkeypatch, 1024)
    warmed = varlen_attention.warm_up(torch.device("cpu"), torch.bfloat16, 4, 2, 8, 2500, q_gate)
    assert warmed == bucket_lengths(2500)
    assert len(keys) == len(warmed)
    width = ((2 if q_gate else 1) * 4 + 2 * 2) * 8
    for n in (1024, 1030, 1500, 2047, 2500):
        rows = bucket_length(n)
        for padded in (0, rows):
            qkv = torch.zeros(max(n, padded), width, dtype=torch.bfloat16)[:n]
            q, k, v = varlen_attention.qkv_views(qkv, 4, 2, 8, q_gate)
            cu = torch.tensor([0, n], dtype=torch.int32)
            varlen_attention.varlen_causal_attention(q, k, v, cu, (n,), 0.3, n, padded)
            assert keys[-1] in keys[: len(warmed)], (n, padded)


def _rows_of(t: torch.Tensor) -> torch.Tensor:
    """The storage t views, as the whole rows from t's first element (row width t.stride(0))."""
    numel = t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()
    return t.as_strided((numel // t.stride(0), t.stride(0)), (t.stride(0), 1))


@pytest.mark.parametrize("q_gate", [False, True])
@pytest.mark.parametrize("n", [45, 1100])
def test_a_padded_projection_is_attended_in_place(q_gate, n):
    """When the qkv projection's buffer holds the bucket's rows with zeros past the chunk (what
    `padded_rows` promises), attention reads views of that buffer: nothing is copied, and each
    real row's output is the unpadded chunk's. A promise the storage cannot keep (a buffer of
    fewer rows) falls back to one copy of the rows into a buffer of the same layout."""
    rows = bucket_length(n)
    width = ((2 if q_gate else 1) * 6 + 2 * 2) * 16
    g = torch.Generator().manual_seed(n)
    buf = torch.zeros(rows, width)
    buf[:n] = torch.randn(n, width, generator=g)
    q, k, v = varlen_attention.qkv_views(buf[:n], 6, 2, 16, q_gate)
    seen = []

    def attend(qt, kt, vt, scale):
        seen.append(tuple(_as_rows(t) for t in (qt, kt, vt)))
        return _reference_attend(qt, kt, vt, scale)

    want = reference.causal_attention(q, k, v, 0.25, 0)
    got = padded_chunk_attention(q, k, v, 0.25, attend, rows)
    torch.testing.assert_close(got, want)
    for padded, real in zip(seen[0], (q, k, v), strict=True):
        assert padded.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
        assert padded.stride() == real.stride() and padded.shape[0] == rows
    short = buf[:n].clone()  # holds n rows only: the promise cannot hold
    q, k, v = varlen_attention.qkv_views(short, 6, 2, 16, q_gate)
    torch.testing.assert_close(padded_chunk_attention(q, k, v, 0.25, attend, rows), want)
    for padded, real in zip(seen[1], (q, k, v), strict=True):
        assert padded.untyped_storage().data_ptr() != short.untyped_storage().data_ptr()
        assert padded.stride() == real.stride() and padded.shape[0] == rows
    assert torch.equal(_rows_of(seen[1][0])[:n], short)
    assert not _rows_of(seen[1][0])[n:rows].any()


@pytest.mark.parametrize(
    ("chunks", "num_heads", "head_dim", "dense"),
    [
        ((MIN_DENSE_CHUNK,), 32, 128, True),  # one long chunk, wide heads: cuDNN
        ((MIN_DENSE_CHUNK,), 16, 256, True),
        ((MIN_DENSE_CHUNK - 1,), 32, 128, False),  # shorter: the paged kernel
        ((MIN_DENSE_CHUNK - 1,), 16, 256, False),
        ((MIN_DENSE_CHUNK,), 16, 128, False),  # narrow heads need a longer chunk
        ((NARROW_HEADS_MIN_DENSE_CHUNK - 1,), 16, 128, False),
        ((NARROW_HEADS_MIN_DENSE_CHUNK,), 16, 128, True),
        ((8192,), 8, 64, True),
        ((4096, 4096), 32, 128, False),  # several chunks: flash varlen loses at head_dim 128
        ((1024,) * 8, 32, 128, False),
        ((4096, 4096), 16, 256, True),  # and wins at 256
        ((37, 5), 16, 256, True),
    ],
)
def test_which_fresh_steps_take_the_dense_path(chunks, num_heads, head_dim, dense):
    assert takes_dense_path(chunks, num_heads, head_dim) is dense


@pytest.mark.parametrize(
    ("q_lens", "seq_lens", "want"),
    [
        ([37, 5, 1], [37, 5, 1], (37, 5, 1)),  # fresh prompts, a one-token prompt among them
        ([8192], [8192], (8192,)),
        ([37, 5], [37, 21], None),  # the second chunk continues a sequence (cached or earlier)
        ([37, 1], [37, 90], None),  # a decode row beside a fresh prompt
        ([], [], None),
    ],
)
def test_fresh_chunk_lengths_only_when_every_chunk_starts_at_zero(q_lens, seq_lens, want):
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    assert fresh_chunk_lengths(cu, np.asarray(seq_lens, dtype=np.int32)) == want


def _attention_paths(monkeypatch) -> list[str]:
    taken = []
    for name in ("paged_attention_decode", "paged_attention_prefill", "varlen_causal_attention"):
        monkeypatch.setattr(
            ops, name, lambda q, *a, _n=name, **k: taken.append(_n) or torch.zeros_like(q)
        )
    return taken


@pytest.mark.parametrize(
    ("decode_only", "fresh", "head_dim", "dense_prefill", "with_kv", "path"),
    [
        (False, (1030,), 8, True, True, "varlen_causal_attention"),  # one long fresh chunk
        (False, (1000, 30), 256, True, True, "varlen_causal_attention"),  # several, wide heads
        (False, (1000, 30), 128, True, True, "paged_attention_prefill"),  # several, head_dim 128
        (False, (1000,), 256, True, True, "paged_attention_prefill"),  # one short chunk
        (False, None, 8, True, True, "paged_attention_prefill"),  # a chunk past position 0
        (False, (1030,), 8, False, True, "paged_attention_prefill"),  # no dense kernels here
        (False, (1030,), 8, True, False, "paged_attention_prefill"),  # one-row paths give q only
        (True, None, 8, True, True, "paged_attention_decode"),
    ],
)
def test_the_layer_picks_its_attention_path_from_the_metadata(
    monkeypatch, decode_only, fresh, head_dim, dense_prefill, with_kv, path
):
    _dense_from(monkeypatch, 1024)  # a lone chunk of these heads from 1,024 tokens
    taken = _attention_paths(monkeypatch)
    layer = PagedAttention(num_heads=4, num_kv_heads=2, head_dim=head_dim, scale=0.35)
    layer.dense_prefill = dense_prefill
    q, k = torch.randn(1030, 4, head_dim), torch.randn(1030, 2, head_dim)
    lens = fresh or (1000, 30)
    set_attention_metadata(
        AttentionMetadata(
            slot_mapping=torch.arange(1030),
            block_tables=torch.zeros(len(lens), 1, dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            decode_only=decode_only,
            cu_seqlens_q=torch.tensor(np.cumsum((0, *lens)), dtype=torch.int32),
            max_seqlen_q=max(lens),
            fresh_chunks=fresh,
        )
    )
    try:
        out = layer(q, k, k.clone()) if with_kv else layer(q)
    finally:
        set_attention_metadata(None)
    assert taken == [path]
    assert out.shape == (1030, 4 * head_dim)


@pytest.mark.parametrize(
    ("env", "heads", "device", "probe", "on", "calls"),
    [
        (None, (32, 128), "cuda", True, True, ["probe", ("warm_up", 1200, False)]),  # wide: on
        (None, (16, 256), "cuda", True, True, ["probe", ("warm_up", 1200, False)]),
        (None, (16, 128), "cuda", True, False, []),  # narrow heads: off unless asked
        ("1", (16, 128), "cuda", True, True, ["probe", ("warm_up", 1200, False)]),
        ("0", (32, 128), "cuda", True, False, []),  # off when asked
        ("1", (32, 128), "cpu", True, False, []),  # never on CPU
        (None, (32, 128), "cpu", True, False, []),
        ("1", (32, 128), "cuda", False, False, ["probe"]),  # the probe fails: the paged kernel
    ],
)
def test_the_runner_turns_the_dense_path_on_by_heads_and_env_and_warms_its_plans(
    monkeypatch, env, heads, device, probe, on, calls
):
    """`_enable_dense_prefill` on a stand-in runner (no GPU needed): on a CUDA device whose probe
    passes, wide query heads take the dense path unless ATOM_DENSE_PREFILL=0, narrow ones only
    with ATOM_DENSE_PREFILL=1; then every attention layer turns it on and the plans of the step
    budget's buckets are built. Otherwise no layer does."""
    seen = []
    monkeypatch.setattr(varlen_attention, "supported", lambda *a: seen.append("probe") or probe)
    monkeypatch.setattr(
        varlen_attention, "warm_up", lambda *a: seen.append(("warm_up", *a[5:])) or [3072, 3328]
    )
    if env is None:
        monkeypatch.delenv(DENSE_PREFILL_ENV, raising=False)
    else:
        monkeypatch.setenv(DENSE_PREFILL_ENV, env)
    runner = SimpleNamespace(
        device=torch.device(device), dtype=torch.bfloat16, max_num_batched_tokens=1200
    )
    num_heads, head_dim = heads
    layers = [
        PagedAttention(num_heads=num_heads, num_kv_heads=4, head_dim=head_dim, scale=0.1)
        for _ in "ab"
    ]
    assert ModelRunner._enable_dense_prefill(runner, layers) is on
    assert [layer.dense_prefill for layer in layers] == [on, on]
    assert seen == calls


def test_dense_reference_equals_the_paged_reference_of_the_same_keys():
    """The dense op's contract is the paged op's for chunks that start at position 0: the same
    q/k/v give the same output whether K/V come packed or from a paged cache (GQA group 3,
    a one-token chunk, a chunk spanning pages)."""
    lens, page, kv_heads, dim = (19, 1, 40), 16, 2, 32
    g = torch.Generator().manual_seed(3)
    q = torch.randn(sum(lens), 6, dim, generator=g)
    k = torch.randn(sum(lens), kv_heads, dim, generator=g)
    v = torch.randn(sum(lens), kv_heads, dim, generator=g)
    cu = torch.tensor([0, 19, 20, 60], dtype=torch.int32)
    tables = torch.tensor([[4, 0, 0], [1, 0, 0], [3, 5, 2]], dtype=torch.int32)
    k_cache, v_cache = torch.full((6, page, kv_heads, dim), float("nan")), None
    v_cache = k_cache.clone()
    for b, n in enumerate(lens):
        for i in range(n):
            k_cache[tables[b, i // page], i % page] = k[cu[b] + i]
            v_cache[tables[b, i // page], i % page] = v[cu[b] + i]
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    dense = ops.varlen_causal_attention(q, k, v, cu, lens, 0.2, 40)
    paged = reference.paged_attention_prefill(q, k_cache, v_cache, cu, seq_lens, tables, 0.2, 40)
    torch.testing.assert_close(dense, paged)


def test_the_dense_op_rejects_chunks_that_do_not_cover_the_rows():
    q, k = torch.randn(5, 4, 8), torch.randn(5, 2, 8)
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="chunks"):
        ops.varlen_causal_attention(q, k, k, cu, (3, 1), 0.35, 3)
    with pytest.raises(ValueError, match="multiple"):
        ops.varlen_causal_attention(q, torch.randn(5, 3, 8), torch.randn(5, 3, 8), cu, (3, 2), 1, 3)


def _record_fresh_chunks(monkeypatch, first: PagedAttention) -> list:
    """What each forward's metadata says, read by the first attention layer."""
    seen = []
    real = PagedAttention.forward

    def forward(self, q, k=None, v=None):
        if self is first:
            meta = get_attention_metadata()
            seen.append("decode" if meta.decode_only else meta.fresh_chunks)
        return real(self, q, k, v)

    monkeypatch.setattr(PagedAttention, "forward", forward)
    return seen


def test_the_runner_marks_only_steps_of_fresh_prompts(tiny_models, monkeypatch):
    """On CPU the dense path stays off even when asked for (no probe runs), and each step's
    metadata says whether every chunk starts at position 0: two fresh prompts together, then
    decodes, then a prompt over their cached prefix, then a long prompt cut into chunks by the
    token budget (its first chunk fresh, the next not)."""
    monkeypatch.setenv(DENSE_PREFILL_ENV, "1")
    llm = LLM(
        str(tiny_models["qwen3"]), dtype="float32", num_gpu_blocks_override=64,
        max_num_batched_tokens=48, max_num_seqs=4,
    )  # fmt: skip
    runner = llm.engine.executor
    assert runner.dense_prefill is False
    layers = runner.model.attention_layers()
    assert not any(layer.dense_prefill for layer in layers)
    seen = _record_fresh_chunks(monkeypatch, layers[0])
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    a, b, long = random_prompts(40, [20, 9, 70])
    llm.generate([{"prompt_token_ids": p} for p in (a, b)], params, use_tqdm=False)
    assert seen == [(20, 9), "decode"]
    seen.clear()
    llm.generate({"prompt_token_ids": a[:16] + b}, params, use_tqdm=False)  # 16 cached tokens
    assert seen == [None, "decode"]
    seen.clear()
    llm.generate({"prompt_token_ids": long}, params, use_tqdm=False)
    assert seen == [(48,), None, "decode"]


@pytest.fixture
def dense_for_any_chunks(monkeypatch) -> list:
    """The dense path's routing thresholds lowered so that the tiny models' short prompts take
    it (one chunk of any length, several at any head size); returns the chunk lengths of each
    call of the dense op."""
    _dense_from(monkeypatch, 1)
    monkeypatch.setattr(varlen_attention, "FLASH_VARLEN_MAX_PAGED_HEAD_DIM", 0)
    calls = []
    real = ops.varlen_causal_attention
    monkeypatch.setattr(ops, "varlen_causal_attention", lambda *a: calls.append(a[4]) or real(*a))
    return calls


def _tokens_and_logprobs(folder, prompts, dense: bool, **kw):
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    llm = LLM(str(folder), dtype="float32", enable_prefix_caching=False, **kw)
    for layer in llm.engine.executor.model.attention_layers():
        layer.dense_prefill = dense
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def _assert_same(got, want):
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        for token, lp in w.logprobs[0].items():
            assert g.logprobs[0][token] == pytest.approx(lp, abs=1e-4)


@pytest.mark.parametrize("kind", ["llama3", "qwen3"])
def test_the_dense_path_gives_the_paged_paths_tokens(tiny_models, kind, dense_for_any_chunks):
    """The layers' dense path forced on (its op is the torch reference on CPU): the k and v
    views `prepare` returns give the tokens and logprobs of the paged path (fp32)."""
    prompts = random_prompts(41, [1, 5, 17, 40])
    kw = dict(num_gpu_blocks_override=64)
    on = _tokens_and_logprobs(tiny_models[kind], prompts, True, **kw)
    assert dense_for_any_chunks and dense_for_any_chunks[0] == (1, 5, 17, 40)
    dense_for_any_chunks.clear()
    _assert_same(on, _tokens_and_logprobs(tiny_models[kind], prompts, False, **kw))
    assert dense_for_any_chunks == []


def test_the_dense_path_gives_the_paged_paths_tokens_in_gated_attention(
    tiny_hybrid_models, dense_for_any_chunks
):
    """The hybrid's gated attention (q strided past its output gates, partial rotary)."""
    prompts = random_prompts(42, [5, 23])
    kw = dict(num_gpu_blocks_override=64, max_num_seqs=2)
    on = _tokens_and_logprobs(tiny_hybrid_models["qwen3_5"], prompts, True, **kw)
    assert dense_for_any_chunks and dense_for_any_chunks[0] == (5, 23)
    _assert_same(on, _tokens_and_logprobs(tiny_hybrid_models["qwen3_5"], prompts, False, **kw))


def test_short_fresh_prompts_keep_the_paged_kernel_in_the_engine(tiny_models, monkeypatch):
    """With the dense path on and its real thresholds, the tiny model's fresh prompts (a step of
    several at head_dim 32, then one of 40 tokens) never reach the dense op."""
    calls = []
    monkeypatch.setattr(ops, "varlen_causal_attention", lambda *a: calls.append(a[4]))
    llm = LLM(str(tiny_models["qwen3"]), dtype="float32", num_gpu_blocks_override=64)
    for layer in llm.engine.executor.model.attention_layers():
        layer.dense_prefill = True
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for prompts in (random_prompts(43, [20, 9]), random_prompts(44, [40])):
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert calls == []


@pytest.mark.parametrize("kind", ["qwen3", "llama3", "qwen3_5"])
def test_the_qkv_projection_is_padded_for_a_lone_fresh_chunk(
    tiny_models, tiny_hybrid_models, monkeypatch, kind
):
    """With the dense path on (forced: CPU; its threshold lowered so short prompts take it), the
    runner's metadata asks for the bucket's rows (`dense_rows`), every qkv projection returns
    the first rows of a buffer that holds them, zeros past the prompt, and attention takes its
    padded views in place (the real `padded_chunk_attention`, the torch reference attending):
    no copy in any layer, and the tokens and logprobs of the paged path (fp32)."""
    _dense_from(monkeypatch, 1)
    calls = []

    def dense(q, k, v, cu, chunks, scale, max_seqlen_q, padded_rows=0):
        assert len(chunks) == 1

        def attend(qt, kt, vt, s):
            shared = qt.untyped_storage().data_ptr() == q.untyped_storage().data_ptr()
            calls.append((chunks[0], padded_rows, shared, qt.shape[2]))
            return _reference_attend(qt, kt, vt, s)

        return padded_chunk_attention(q, k, v, scale, attend, padded_rows)

    monkeypatch.setattr(ops, "varlen_causal_attention", dense)
    folder = {**tiny_models, **tiny_hybrid_models}[kind]
    prompts = random_prompts(45, [5, 23, 41])
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True)
    outs = {}
    for on in (True, False):
        llm = LLM(str(folder), dtype="float32", enable_prefix_caching=False,
                  num_gpu_blocks_override=64)  # fmt: skip
        llm.engine.executor.dense_prefill = on  # what the start-up probe would set on a GPU
        layers = llm.engine.executor.model.attention_layers()
        for layer in layers:
            layer.dense_prefill = on
        outs[on] = [
            llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0].outputs[0]
            for p in prompts  # one at a time: each prompt's step holds its lone chunk
        ]
        llm.shutdown()
    want = [(n, bucket_length(n), True, bucket_length(n)) for n in (5, 23, 41)]
    assert calls == [c for c in want for _ in layers]
    _assert_same(outs[True], outs[False])

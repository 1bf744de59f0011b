"""Fresh prompts' dense prefill path, on CPU: which attention path a step's metadata picks, the
metadata the runner builds for each kind of step, and the engine's output with the dense path
forced on (its op runs the torch reference on CPU) against the paged path. On a GPU the path
runs torch's SDPA or flash attention (tests/kernels/test_triton_kernels_gpu.py,
test_gpu_engine.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from atom_kernels import ops, reference
from atom_runtime import LLM, SamplingParams
from atom_runtime.forward_context import (
    AttentionMetadata,
    fresh_chunk_lengths,
    get_attention_metadata,
    set_attention_metadata,
)
from atom_runtime.layers.attention import PagedAttention
from tests.runtime.test_parity import _prompts


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
    ("decode_only", "fresh", "dense_prefill", "with_kv", "path"),
    [
        (False, (3, 2), True, True, "varlen_causal_attention"),
        (False, None, True, True, "paged_attention_prefill"),  # a chunk past position 0
        (False, (3, 2), False, True, "paged_attention_prefill"),  # no flash attention here
        (False, (3, 2), True, False, "paged_attention_prefill"),  # one-row paths give q only
        (True, None, True, True, "paged_attention_decode"),
    ],
)
def test_the_layer_picks_its_attention_path_from_the_metadata(
    monkeypatch, decode_only, fresh, dense_prefill, with_kv, path
):
    taken = _attention_paths(monkeypatch)
    layer = PagedAttention(num_heads=4, num_kv_heads=2, head_dim=8, scale=0.35)
    layer.dense_prefill = dense_prefill
    q, k = torch.randn(5, 4, 8), torch.randn(5, 2, 8)
    set_attention_metadata(
        AttentionMetadata(
            slot_mapping=torch.arange(5),
            block_tables=torch.zeros(2, 1, dtype=torch.int32),
            seq_lens=torch.tensor([3, 2], dtype=torch.int32),
            decode_only=decode_only,
            cu_seqlens_q=torch.tensor([0, 3, 5], dtype=torch.int32),
            max_seqlen_q=3,
            fresh_chunks=fresh,
        )
    )
    try:
        out = layer(q, k, k.clone()) if with_kv else layer(q)
    finally:
        set_attention_metadata(None)
    assert taken == [path]
    assert out.shape == (5, 32)


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
    """On CPU the dense path is off (no probe runs), and each step's metadata says whether
    every chunk starts at position 0: two fresh prompts together, then decodes, then a prompt
    over their cached prefix, then a long prompt cut into chunks by the token budget (its first
    chunk fresh, the next not)."""
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
    a, b, long = _prompts(40, [20, 9, 70])
    llm.generate([{"prompt_token_ids": p} for p in (a, b)], params, use_tqdm=False)
    assert seen == [(20, 9), "decode"]
    seen.clear()
    llm.generate({"prompt_token_ids": a[:16] + b}, params, use_tqdm=False)  # 16 cached tokens
    assert seen == [None, "decode"]
    seen.clear()
    llm.generate({"prompt_token_ids": long}, params, use_tqdm=False)
    assert seen == [(48,), None, "decode"]


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
def test_the_dense_path_gives_the_paged_paths_tokens(tiny_models, kind):
    """The layers' dense path forced on (its op is the torch reference on CPU): the k and v
    views `prepare` returns give the tokens and logprobs of the paged path (fp32)."""
    prompts = _prompts(41, [1, 5, 17, 40])
    kw = dict(num_gpu_blocks_override=64)
    on = _tokens_and_logprobs(tiny_models[kind], prompts, True, **kw)
    _assert_same(on, _tokens_and_logprobs(tiny_models[kind], prompts, False, **kw))


def test_the_dense_path_gives_the_paged_paths_tokens_in_gated_attention(tiny_hybrid_models):
    """The hybrid's gated attention (q strided past its output gates, partial rotary)."""
    prompts = _prompts(42, [5, 23])
    kw = dict(num_gpu_blocks_override=64, max_num_seqs=2)
    on = _tokens_and_logprobs(tiny_hybrid_models["qwen3_5"], prompts, True, **kw)
    _assert_same(on, _tokens_and_logprobs(tiny_hybrid_models["qwen3_5"], prompts, False, **kw))

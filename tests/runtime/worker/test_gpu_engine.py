"""The engine on a GPU: greedy parity with transformers in fp32 (Triton kernels, with and without
CUDA graphs), CUDA-graph replay equal to eager mode, and bf16 staying close (agreement reported)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from atom_runtime import LLM, SamplingParams
from atom_runtime.protocol.engine_core import EngineRequest
from tests.hf_reference import atom_greedy, hf_greedy, hf_logprobs, random_prompts

pytestmark = pytest.mark.gpu

KINDS = ["llama", "llama3", "qwen2", "qwen3"]
PROMPTS = random_prompts(0, [1, 5, 16, 17, 40, 97, 130])


MAX_TOKENS = 12


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_fp32_greedy_parity_on_gpu(tiny_models, kind, enforce_eager):
    expected = hf_greedy(tiny_models[kind], PROMPTS, MAX_TOKENS)
    llm = LLM(
        str(tiny_models[kind]),
        dtype="float32",
        device="cuda",
        num_gpu_blocks_override=256,
        enforce_eager=enforce_eager,
        max_num_seqs=16,
    )
    assert atom_greedy(llm, PROMPTS, MAX_TOKENS) == expected


def test_cuda_graph_replay_gives_the_same_tokens_as_eager(tiny_models):
    # fp32: a graph's block tables are as wide as the model's context, an eager step's as its
    # longest sequence, so decode attention splits the context differently; in bf16 that
    # rounding alone flips near-tied argmaxes of a random tiny model now and then.
    prompts = random_prompts(5, [3, 9, 14, 33, 2, 7, 61, 18, 5, 40, 11, 27, 8])  # 13: padded to 16
    kw = dict(dtype="float32", device="cuda", num_gpu_blocks_override=512, max_num_seqs=32)
    eager = LLM(str(tiny_models["qwen3"]), enforce_eager=True, **kw)
    graphs = LLM(str(tiny_models["qwen3"]), enforce_eager=False, **kw)
    assert graphs.engine.executor.graphs, "no CUDA graph was captured"
    assert atom_greedy(graphs, prompts, 24) == atom_greedy(eager, prompts, 24)


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_async_scheduling_gives_the_same_tokens_as_the_synchronous_loop(tiny_models, enforce_eager):
    prompts = random_prompts(9, [3, 9, 14, 33, 2, 7, 61, 18, 5])
    kw = dict(
        dtype="bfloat16",
        device="cuda",
        num_gpu_blocks_override=512,
        max_num_seqs=16,
        enforce_eager=enforce_eager,
    )
    on = LLM(str(tiny_models["qwen3"]), async_scheduling=True, **kw)
    off = LLM(str(tiny_models["qwen3"]), async_scheduling=False, **kw)
    assert atom_greedy(on, prompts, 20) == atom_greedy(off, prompts, 20)
    assert atom_greedy(on, prompts[:1], 20) == atom_greedy(
        off, prompts[:1], 20
    )  # batch 1: GEMV path
    seeded = SamplingParams(temperature=0.9, seed=5, max_tokens=16, ignore_eos=True)
    draw = [{"prompt_token_ids": p} for p in prompts[:4]]
    assert [o.outputs[0].token_ids for o in on.generate(draw, seeded, use_tqdm=False)] == [
        o.outputs[0].token_ids for o in off.generate(draw, seeded, use_tqdm=False)
    ]
    for llm in (on, off):
        assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_blocks


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_stays_close_to_fp32_reference(tiny_models, kind):
    expected = hf_greedy(tiny_models[kind], PROMPTS, MAX_TOKENS)
    llm = LLM(str(tiny_models[kind]), dtype="bfloat16", device="cuda", num_gpu_blocks_override=256)
    got = atom_greedy(llm, PROMPTS, MAX_TOKENS)
    pairs = [(a, b) for g, e in zip(got, expected, strict=True) for a, b in zip(g, e, strict=True)]
    agreement = sum(a == b for a, b in pairs) / len(pairs)
    first = sum(g[0] == e[0] for g, e in zip(got, expected, strict=True)) / len(got)
    report = os.environ.get("ATOM_REPORT_DIR")
    if report:
        with open(os.path.join(report, f"bf16_agreement_{kind}.json"), "w") as f:
            json.dump({"kind": kind, "token_agreement": agreement, "first_token": first}, f)
    print(f"bf16 {kind}: token agreement {agreement:.3f}, first-token {first:.3f}")
    assert first >= 0.7
    # First-step logprobs in bf16 stay within bf16's resolution of the fp32 reference.
    ref = hf_logprobs(tiny_models[kind], [PROMPTS[4]])[0][-1]
    out = llm.generate(
        {"prompt_token_ids": PROMPTS[4]},
        SamplingParams(temperature=0, max_tokens=1, logprobs=5),
        use_tqdm=False,
    )
    for token, lp in out[0].outputs[0].logprobs[0].items():
        assert lp == pytest.approx(ref[token].item(), abs=0.15)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_one_row_paths_agree_compiled_in_bf16(tiny_models, kind):
    """Every batch-1 projection path (cuBLAS, the GEMV, the GEMV with the norm, SwiGLU or
    rotary + cache store fused in) run compiled inside the engine: the first decode step (the
    first one-row step; the prefill has many rows and takes cuBLAS on every path) gives the
    same top logprobs within bf16's resolution. Compared per step, not as greedy sequences: a
    near-tie flipped by a rounding would make later tokens diverge. Eager, so the layer flags
    set here take effect (graphs keep what was captured)."""
    from atom_runtime.worker.kernel_choice import small_m_groups, small_m_paths, use_small_m_path

    llm = LLM(
        str(tiny_models[kind]),
        dtype="bfloat16",
        device="cuda",
        num_gpu_blocks_override=256,
        enforce_eager=True,
    )
    groups = small_m_groups(llm.engine.executor.model)
    # The qkv GEMV can take rotary + the cache store (Qwen3: its QK-norm as well).
    assert any("gemv+rope" in small_m_paths(g[0]) for g in groups.values())
    params = SamplingParams(temperature=0, max_tokens=2, logprobs=5, ignore_eos=True)
    steps = {}
    for pick in ("cublas", "gemv", "fused"):
        for layers in groups.values():
            paths = small_m_paths(layers[0])
            use_small_m_path(layers, {"cublas": "cublas", "gemv": "gemv"}.get(pick, paths[-1]))
        steps[pick] = [
            llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0].outputs[0].logprobs[1]
            for p in PROMPTS[1:5]  # several tokens each: the prefill never takes one-row paths
        ]
    for pick in ("gemv", "fused"):
        for want, got in zip(steps["cublas"], steps[pick], strict=True):
            common = set(want) & set(got)
            assert len(common) >= 3, pick
            for token in common:
                assert got[token] == pytest.approx(want[token], abs=0.08), pick


def test_short_chunk_over_a_cached_prefix_matches_a_full_prefill(tiny_models):
    """W3 in miniature on the GPU: a 30-token suffix over a cached 900-token prefix runs as
    one short chunk with split-KV attention (few programs, a long context); its greedy tokens
    equal those of the same prompt prefilled whole with caching off (fp32)."""
    from atom_kernels import prefill_attention

    prefix = random_prompts(11, [900])[0]
    suffixes = random_prompts(12, [30, 30])
    kw = dict(dtype="float32", device="cuda", num_gpu_blocks_override=256, max_num_seqs=4)
    cached = LLM(str(tiny_models["qwen2"]), enable_prefix_caching=True, **kw)
    cold = LLM(str(tiny_models["qwen2"]), enable_prefix_caching=False, **kw)
    atom_greedy(cached, [prefix + suffixes[0]], 1)  # computes and publishes the prefix
    prompt = prefix + suffixes[1]
    got = atom_greedy(cached, [prompt], 8)
    assert cached.engine.scheduler.prefix_hits >= 896  # the prefix's full blocks
    cfg = cached.engine.model_config
    plan = prefill_attention.plan_prefill_launch(
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        page_size=cached.config.block_size,
        batch=1,
        max_seqlen_q=len(prompt) - 896,
        max_context=-(-len(prompt) // cached.config.block_size) * cached.config.block_size,
        num_multiprocessors=torch.cuda.get_device_properties(0).multi_processor_count,
    )
    assert plan.num_splits > 1, "the cached step should take the split-KV path"
    assert got == atom_greedy(cold, [prompt], 8)


def test_prefill_graphs_give_the_same_tokens_as_eager_prefill(tiny_models):
    """Short prefill and mixed steps replay captured graphs (padded to their bucket): a short
    prompt alone, new tokens over a cached prefix, and prompts arriving while others decode
    (chunks beside decode rows, async scheduling on) give the tokens of eager prefill (fp32),
    and the graphs did serve those steps."""
    kw = dict(dtype="float32", device="cuda", num_gpu_blocks_override=256, max_num_seqs=8)
    eager = LLM(str(tiny_models["qwen3"]), prefill_graph_max_tokens=0, **kw)
    graphs = LLM(str(tiny_models["qwen3"]), prefill_graph_max_tokens=64, **kw)
    runner = graphs.engine.executor
    assert runner.prefill_graphs, "no prefill graph was captured"
    assert not eager.engine.executor.prefill_graphs
    prefix = random_prompts(21, [200])[0]
    cases = [  # (prompts, whether a graph runs their prefill)
        (random_prompts(22, [7]), True),  # one short prompt: bucket (16, 1)
        ([prefix + p for p in random_prompts(23, [5])], False),  # caches the prefix (205 tokens)
        ([prefix + p for p in random_prompts(24, [9, 30])], True),  # 17 + 38 new tokens over it
        (random_prompts(25, [3, 11, 2, 40, 17]), False),  # 73 tokens: eager, then graph decodes
    ]
    for prompts, replayed in cases:
        before = runner.prefill_graphs.replays
        assert atom_greedy(graphs, prompts, 10) == atom_greedy(eager, prompts, 10), prompts
        assert (runner.prefill_graphs.replays > before) == replayed, prompts
    # Prompts arriving one by one while earlier ones decode: mixed steps of chunk + decodes.
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = random_prompts(26, [6, 13, 4, 21, 9, 33])
    want = atom_greedy(eager, prompts, 12)
    engine = graphs.engine
    before = runner.prefill_graphs.replays
    outputs = []
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(f"m{i}", p, params))
        outputs.append(engine.step())
    while engine.has_unfinished_requests():
        outputs.append(engine.step())
    got = [[t for o in outputs for t in o.tokens_by_request().get(f"m{i}", [])] for i in range(6)]
    assert got == want
    assert runner.prefill_graphs.replays >= before + len(prompts) - 1


@pytest.mark.parametrize("kind", ["llama3", "qwen3"])
def test_programmatic_dependent_launch_gives_the_same_tokens(tiny_models, kind, monkeypatch):
    """With PDL (on by default from Hopper on) every decode kernel waits for the one before at
    its start, so the tokens under CUDA graphs and eagerly are those without it (fp32)."""
    from atom_kernels import pdl

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0 or later")
    # Eight prompts, 147 tokens: the first step replays a prefill graph, then decode graphs.
    prompts = random_prompts(31, [3, 9, 14, 33, 2, 7, 61, 18])
    kw = dict(dtype="float32", device="cuda", num_gpu_blocks_override=256, max_num_seqs=16)
    monkeypatch.setenv("ATOM_PDL", "0")
    pdl._enabled.cache_clear()
    want = atom_greedy(LLM(str(tiny_models[kind]), **kw), prompts, 24)
    monkeypatch.setenv("ATOM_PDL", "1")
    pdl._enabled.cache_clear()
    try:
        assert pdl.enabled(torch.device("cuda")), "PDL did not turn on"
        for eager in (False, True):
            llm = LLM(str(tiny_models[kind]), enforce_eager=eager, **kw)
            assert atom_greedy(llm, prompts, 24) == want, f"enforce_eager={eager}"
    finally:
        pdl._enabled.cache_clear()


def test_a_failed_prefill_capture_leaves_those_steps_eager(tiny_models, monkeypatch, caplog):
    """A GPU stack that cannot capture the prefill path (say a ROCm build that refuses one of
    its kernels under capture) starts anyway: a warning, short prefill steps run eagerly, same
    tokens."""
    from atom_runtime.worker import cuda_graphs

    def refuse(self, *args, **kwargs):
        raise RuntimeError("capture refused")

    prompts = random_prompts(41, [7, 12, 30])
    kw = dict(dtype="float32", device="cuda", num_gpu_blocks_override=128, max_num_seqs=4)
    want = atom_greedy(
        LLM(str(tiny_models["qwen3"]), prefill_graph_max_tokens=0, **kw), prompts, MAX_TOKENS
    )
    monkeypatch.setattr(cuda_graphs.PrefillGraphs, "capture", refuse)
    with caplog.at_level("WARNING", logger="atom_runtime.worker.model_runner"):
        llm = LLM(str(tiny_models["qwen3"]), **kw)
    assert "run eagerly" in caplog.text and "capture refused" in caplog.text
    assert not llm.engine.executor.prefill_graphs
    assert llm.engine.executor.graphs, "the decode graphs are captured all the same"
    assert atom_greedy(llm, prompts, MAX_TOKENS) == want


def _dense_for_short_prompts(monkeypatch) -> None:
    """The dense path's routing thresholds lowered for the tiny models (head_dim 16 and 32, at
    most 1,024 positions): one fresh chunk from 64 tokens, several at any head size. Set before
    the engine starts, so its warm-up builds the plans of the buckets from 64 tokens."""
    from atom_kernels import varlen_attention

    monkeypatch.setattr(varlen_attention, "MIN_DENSE_CHUNK", 64)
    monkeypatch.setattr(varlen_attention, "NARROW_HEADS_MIN_DENSE_CHUNK", 64)
    monkeypatch.setattr(varlen_attention, "FLASH_VARLEN_MAX_PAGED_HEAD_DIM", 0)


@pytest.mark.parametrize("kind", ["llama3", "qwen3", "qwen3_5"])
def test_fresh_prompts_attend_densely_and_agree_with_the_paged_kernel(
    tiny_models, tiny_hybrid_models, kind, monkeypatch
):
    """bf16 (the dense kernels' dtypes), the dense path turned on, its thresholds lowered: a
    step of fresh prompts runs the dense path (four short prompts: one flash launch; one prompt:
    SDPA, padded), and the first token's top logprobs of the dense path match the paged kernel's
    within bf16's resolution (the hybrid: gated attention, q strided past its gates). Eager
    with no prefill graphs, so flipping the layers' flag takes effect."""
    from atom_kernels import ops

    monkeypatch.setenv("ATOM_DENSE_PREFILL", "1")
    _dense_for_short_prompts(monkeypatch)
    llm = LLM(
        str({**tiny_models, **tiny_hybrid_models}[kind]),
        dtype="bfloat16",
        device="cuda",
        num_gpu_blocks_override=256,
        enforce_eager=True,
        prefill_graph_max_tokens=0,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        enable_prefix_caching=False,
    )
    runner = llm.engine.executor
    assert runner.dense_prefill
    layers = runner.model.attention_layers()
    calls = []
    real = ops.varlen_causal_attention
    monkeypatch.setattr(ops, "varlen_causal_attention", lambda *a: calls.append(a[4]) or real(*a))
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    steps = [PROMPTS[2:6], PROMPTS[6:7]]  # 16 + 17 + 40 + 97 tokens; 130 tokens alone

    def first_logprobs():
        return [
            o.outputs[0].logprobs[0]
            for prompts in steps
            for o in llm.generate(
                [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
            )
        ]

    dense = first_logprobs()
    assert calls == [(16, 17, 40, 97)] * len(layers) + [(130,)] * len(layers)
    for layer in layers:
        layer.dense_prefill = False
    paged = first_logprobs()
    assert len(calls) == 2 * len(layers)  # the flag off: the paged kernel only
    for want, got in zip(paged, dense, strict=True):
        common = set(want) & set(got)
        assert len(common) >= 3
        for token in common:
            assert got[token] == pytest.approx(want[token], abs=0.08)


def test_a_chunk_over_a_cached_prefix_keeps_the_paged_kernel(tiny_models, monkeypatch):
    """bf16, dense path on (thresholds lowered): the prompt's first run is one fresh step; its
    second run hits the prefix cache, so its chunk starts past position 0 and takes the paged
    kernel."""
    from atom_kernels import ops

    monkeypatch.setenv("ATOM_DENSE_PREFILL", "1")
    _dense_for_short_prompts(monkeypatch)
    llm = LLM(str(tiny_models["qwen3"]), dtype="bfloat16", device="cuda",
              num_gpu_blocks_override=256, enforce_eager=True,
              max_num_batched_tokens=512)  # fmt: skip
    n_layers = len(llm.engine.executor.model.attention_layers())
    calls = []
    real = ops.varlen_causal_attention
    monkeypatch.setattr(ops, "varlen_causal_attention", lambda *a: calls.append(a[4]) or real(*a))
    prompt = PROMPTS[6]  # 130 tokens: 8 full blocks cached after the first run
    atom_greedy(llm, [prompt], 2)
    assert calls == [(130,)] * n_layers
    atom_greedy(llm, [prompt + random_prompts(31, [20])[0]], 2)
    assert calls == [(130,)] * n_layers


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_fresh_prompts_of_first_seen_lengths_find_plans_built_at_start_up(
    tiny_models, tiny_hybrid_models, kind, monkeypatch, caplog
):
    """bf16, the dense path turned on (thresholds lowered to 64 tokens): the start-up builds
    one cuDNN plan per bucket of the 512-token budget (and logs it), and prompts of lengths the
    engine never saw reach SDPA with a plan-cache key (sizes, strides, dtype, device) start-up
    already presented, so no request builds a plan; the qkv projection's padded rows are
    attended in place (the hybrid: gated attention's layout)."""
    from atom_kernels import varlen_attention

    monkeypatch.setenv("ATOM_DENSE_PREFILL", "1")
    _dense_for_short_prompts(monkeypatch)
    keys = []
    real = varlen_attention.sdpa_causal

    def record(q, k, v, scale):
        keys.append(tuple((t.shape, t.stride(), t.dtype, t.device) for t in (q, k, v)))
        return real(q, k, v, scale)

    monkeypatch.setattr(varlen_attention, "sdpa_causal", record)
    kw = dict(dtype="bfloat16", device="cuda", num_gpu_blocks_override=256, enforce_eager=True,
              max_num_batched_tokens=512, enable_prefix_caching=False)  # fmt: skip
    with caplog.at_level("INFO", logger="atom_runtime.worker.model_runner"):
        llm = LLM(str({**tiny_models, **tiny_hybrid_models}[kind]), **kw)
    runner = llm.engine.executor
    assert runner.dense_prefill
    first = runner.model.attention_layers()[0]
    heads = (first.num_heads, first.num_kv_heads, first.head_dim, torch.bfloat16)
    if torch.version.hip is None:  # the probe found cuDNN's op callable directly for these heads
        assert heads in varlen_attention._CUDNN_DIRECT
    warmed = varlen_attention.bucket_lengths(512)
    assert f"cuDNN plans for {len(warmed)} prompt-length buckets (64-512 tokens)" in caplog.text
    at_start = set(keys)
    started = len(keys)
    copied = []
    real_row_width = varlen_attention._row_width  # reached only when the rows must be copied
    monkeypatch.setattr(
        varlen_attention, "_row_width", lambda *a: copied.append(a) or real_row_width(*a)
    )
    prompts = random_prompts(32, [77, 333, 501])
    for p in prompts:
        atom_greedy(llm, [p], 2)
    served = keys[started:]
    assert len(served) == len(prompts) * len(runner.model.attention_layers())
    assert set(served) <= at_start
    assert copied == []

"""Speculative decoding on a GPU: verify steps replay their captured CUDA graphs (padded rows
for sequences short of k drafts), the few-row path is chosen, and greedy output stays the plain
engine's, for a dense model and a hybrid one with its MTP head."""

from __future__ import annotations

import pytest

from atom_runtime import LLM, SamplingParams
from tests.runtime.spec_decode.oracle import OracleDrafter, install

pytestmark = pytest.mark.gpu

K = 4
PROMPTS = [[11, 22, 33, 44, 55, 11, 22, 33], list(range(100, 137)), [9, 8, 7]]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _ids(llm, prompts=PROMPTS):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def gpu_models(tmp_path_factory):
    from tests.model_factory import make_tiny_model

    root = tmp_path_factory.mktemp("spec_gpu")
    return {
        "qwen3": make_tiny_model(root / "qwen3", "qwen3"),
        "qwen3_5": make_tiny_model(root / "qwen3_5", "qwen3_5", mtp_layers=1),
    }


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_verify_steps_replay_graphs_and_keep_greedy_output(gpu_models, kind):
    plain = LLM(str(gpu_models[kind]), dtype="float32", gpu_memory_utilization=0.3)
    try:
        want = _ids(plain)
    finally:
        plain.shutdown()
    llm = LLM(str(gpu_models[kind]), dtype="float32", gpu_memory_utilization=0.3,
              speculative_config={"method": "ngram", "num_speculative_tokens": K})  # fmt: skip
    try:
        truth = {tuple(p): ids for p, ids in zip(PROMPTS, want, strict=True)}
        # Drafts cut short now and then (padded rows) and wrong at rotating positions.
        install(llm, OracleDrafter(truth, K, lambda s, p: p == s % (K + 2)))
        assert _ids(llm) == want
        assert llm.engine.executor.verify_graphs.replays > 0
    finally:
        llm.shutdown()


def test_mtp_on_the_gpu_keeps_greedy_output(gpu_models):
    plain = LLM(str(gpu_models["qwen3_5"]), dtype="float32", gpu_memory_utilization=0.3)
    try:
        want = _ids(plain)
    finally:
        plain.shutdown()
    llm = LLM(str(gpu_models["qwen3_5"]), dtype="float32", gpu_memory_utilization=0.3,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})  # fmt: skip
    try:
        assert _ids(llm) == want
        assert llm.engine.scheduler.spec_stats.num_draft_tokens > 0
        assert llm.engine.executor.draft_graphs.catch_up.replays > 0
    finally:
        llm.shutdown()


@pytest.mark.parametrize("case", ["draft_model", "deepseek_mtp"])
def test_drafter_steps_replay_graphs_and_keep_greedy_output(tmp_path_factory, case):
    """The drafter's catch-up and draft steps replay its CUDA graphs (k = 3: two one-token
    draft steps), and greedy output stays the plain engine's: a draft model of the target's own
    weights (every draft accepted: the catch-up's widest rows) and DeepSeek's MTP head (random:
    nearly every draft rejected)."""
    from tests.model_factory import make_tiny_model

    root = tmp_path_factory.mktemp(case)
    if case == "draft_model":
        target = make_tiny_model(root / "qwen2", "qwen2")
        spec = {"model": str(target), "num_speculative_tokens": 3}
    else:
        target = make_tiny_model(root / "deepseek", "deepseek_v3", mtp_layers=1)
        spec = {"method": "deepseek_mtp", "num_speculative_tokens": 3}
    common = dict(dtype="float32", gpu_memory_utilization=0.3)
    plain = LLM(str(target), **common)
    try:
        want = _ids(plain)
    finally:
        plain.shutdown()
    llm = LLM(str(target), speculative_config=spec, **common)
    try:
        assert _ids(llm) == want
        graphs = llm.engine.executor.draft_graphs
        assert graphs.catch_up.replays > 0 and set(graphs.drafts) == {0}
        if case == "draft_model":
            assert llm.engine.scheduler.spec_stats.acceptance_rate == 1.0
    finally:
        llm.shutdown()


def test_bf16_few_row_product_matches_cublas():
    import torch

    from atom_kernels import gemv_rows

    g = torch.Generator(device="cuda").manual_seed(0)
    for m, n, k in ((5, 4096, 4096), (2, 14336 * 2, 4096), (8, 4096, 14336)):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
        want = torch.nn.functional.linear(x, w)
        torch.testing.assert_close(gemv_rows.linear_few_rows(x, w), want, atol=2e-2, rtol=2e-2)


def test_fp8_kv_and_bf16_state_under_verify_graphs_keep_greedy_output(gpu_models):
    """--kv-cache-dtype fp8 --mamba-ssm-cache-dtype bfloat16 with the MTP head: the verify
    graphs (FP8 cache scales, per-position bf16 states) give the same engine's output without
    speculation; n-gram drafts wrong at rotating positions exercise rejection."""
    narrow = dict(dtype="float32", gpu_memory_utilization=0.3, kv_cache_dtype="fp8",
                  mamba_ssm_cache_dtype="bfloat16")  # fmt: skip
    plain = LLM(str(gpu_models["qwen3_5"]), **narrow)
    try:
        want = _ids(plain)
    finally:
        plain.shutdown()
    for spec in ({"method": "mtp", "num_speculative_tokens": 2},
                 {"method": "ngram", "num_speculative_tokens": K}):  # fmt: skip
        llm = LLM(str(gpu_models["qwen3_5"]), speculative_config=spec, **narrow)
        try:
            if spec["method"] == "ngram":
                truth = {tuple(p): ids for p, ids in zip(PROMPTS, want, strict=True)}
                install(llm, OracleDrafter(truth, K, lambda s, p: p == s % (K + 2)))
            assert _ids(llm) == want
            assert llm.engine.executor.verify_graphs.replays > 0
        finally:
            llm.shutdown()

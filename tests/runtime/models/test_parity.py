"""Greedy parity with Hugging Face transformers on small random models (fp32, CPU).

The engine must produce the same tokens as `transformers.generate` for a batch of prompts of very
different lengths, also when the token budget forces chunked prefill, when shared prefixes hit the
prefix cache, and when a KV pool too small for the batch forces preemption; first-step logprobs
must be close.
"""

from __future__ import annotations

import pytest

from atom_runtime import LLM, SamplingParams
from tests.hf_reference import atom_greedy, hf_greedy, hf_logprobs, random_prompts

KINDS = ["llama", "llama3", "qwen2", "qwen3"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def references(tiny_models):
    prompts = random_prompts(0, [1, 5, 16, 17, 40, 97])
    return prompts, {kind: hf_greedy(tiny_models[kind], prompts, MAX_TOKENS) for kind in KINDS}


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_tokens_match_transformers(tiny_models, references, kind):
    prompts, expected = references
    llm = LLM(str(tiny_models[kind]), dtype="float32", num_gpu_blocks_override=256)
    assert atom_greedy(llm, prompts, MAX_TOKENS) == expected[kind]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_chunked_prefill_with_tiny_budget_matches(tiny_models, references, kind):
    prompts, expected = references
    llm = LLM(
        str(tiny_models[kind]),
        dtype="float32",
        num_gpu_blocks_override=256,
        max_num_batched_tokens=7,
        max_num_seqs=4,
    )
    assert atom_greedy(llm, prompts, MAX_TOKENS) == expected[kind]


def test_prefix_hits_give_the_same_tokens(tiny_models):
    shared = random_prompts(1, [48])[0]
    prompts = [shared + tail for tail in random_prompts(2, [3, 9, 20])]
    expected = hf_greedy(tiny_models["qwen2"], prompts, MAX_TOKENS)
    llm = LLM(str(tiny_models["qwen2"]), dtype="float32", num_gpu_blocks_override=128)
    assert atom_greedy(llm, prompts, MAX_TOKENS) == expected
    again = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in again] == expected
    # 48 shared tokens = 3 full blocks of 16 served from the cache on the second run.
    assert all(o.num_cached_tokens >= 48 for o in again)


def test_preemption_under_a_small_kv_pool_matches(tiny_models, references):
    prompts, expected = references
    # 9 blocks of 16 tokens cannot hold all six sequences at once: some are preempted.
    llm = LLM(
        str(tiny_models["llama"]), dtype="float32", num_gpu_blocks_override=9, max_model_len=120
    )
    assert atom_greedy(llm, prompts, MAX_TOKENS) == expected["llama"]
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.pool.num_free_blocks == 9


@pytest.mark.parametrize("kind", ["llama3", "qwen3"])
def test_first_step_logprobs_close_to_transformers(tiny_models, kind):
    prompt = random_prompts(3, [23])[0]
    ref = hf_logprobs(tiny_models[kind], [prompt])[0][-1]
    llm = LLM(str(tiny_models[kind]), dtype="float32", num_gpu_blocks_override=64)
    out = llm.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0, max_tokens=1, logprobs=5),
        use_tqdm=False,
    )[0].outputs[0]
    top = out.logprobs[0]
    ref_top = ref.topk(5)
    assert list(top)[1:] == ref_top.indices.tolist() or set(top) >= set(ref_top.indices.tolist())
    for token, lp in top.items():
        assert lp == pytest.approx(ref[token].item(), abs=1e-4)

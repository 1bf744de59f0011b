"""The sparse-MoE families on a GPU: greedy parity with transformers in fp32 through the Triton
kernels (fused MoE with GPT-OSS's biases and clamp, windowed and sink attention over the window
layers' own blocks), eagerly and through CUDA graphs (the window tables as graph inputs),
chunked prefill; graph replay equal to eager over long GPT-OSS generations (blocks given back
and reused while graphs replay); and bf16 dummy-weight engines of Qwen3-30B-A3B's and
GPT-OSS-20B's real shapes starting and serving a batch."""

from __future__ import annotations

import pytest

from atom_runtime import LLM
from tests.hf_reference import atom_greedy, hf_greedy, random_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(1200)]

KINDS = ["qwen3_moe", "mixtral", "gpt_oss"]
PROMPTS = random_prompts(0, [1, 5, 17, 40, 97])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_fp32_greedy_parity_on_gpu(tiny_moe_models, kind, enforce_eager):
    expected = hf_greedy(tiny_moe_models[kind], PROMPTS, 8)
    llm = LLM(
        str(tiny_moe_models[kind]), dtype="float32", device="cuda", num_gpu_blocks_override=256,
        enforce_eager=enforce_eager, max_num_batched_tokens=24, max_num_seqs=16,
    )  # fmt: skip
    assert atom_greedy(llm, PROMPTS, 8) == expected


def test_gpt_oss_graph_replay_over_long_generations_gives_eager_tokens(tiny_moe_models):
    # 13 prompts through a pool that must reuse the window blocks given back as they grow.
    prompts = random_prompts(5, [3, 90, 14, 33, 2, 7, 61, 18, 5, 40, 11, 27, 8])
    kw = dict(dtype="float32", device="cuda", num_gpu_blocks_override=96, max_num_seqs=8)
    eager = LLM(str(tiny_moe_models["gpt_oss"]), enforce_eager=True, **kw)
    graphs = LLM(str(tiny_moe_models["gpt_oss"]), enforce_eager=False, **kw)
    assert graphs.engine.executor.graphs, "no CUDA graph was captured"
    assert atom_greedy(graphs, prompts, 64) == atom_greedy(eager, prompts, 64)


@pytest.mark.parametrize("config", ["qwen3-30b-a3b", "gpt-oss-20b"])
def test_bf16_dummy_engines_of_the_released_shapes_serve(config):
    llm = LLM(f"benchmarks/configs/{config}", load_format="dummy", max_num_seqs=32)
    outs = atom_greedy(llm, random_prompts(1, [500, 37, 1200, 3]), 32)
    assert [len(o) for o in outs] == [32] * 4
    assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_blocks

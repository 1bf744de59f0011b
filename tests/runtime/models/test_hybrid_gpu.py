"""Hybrid models on a GPU: greedy parity with transformers in fp32 (Triton GDN/conv/MoE kernels,
eager and CUDA graphs with slot ids as graph inputs, async scheduling on), graph replay equal to
eager under slot reuse, and a bf16 dummy-weight engine of the Qwen3.5-4B shape starting, sizing
its slots from the memory left after the weights and serving a batch."""

from __future__ import annotations

import pytest

from atom_runtime import LLM
from tests.hf_reference import atom_greedy, random_prompts
from tests.runtime.models.test_hybrid import MAX_TOKENS, PROMPTS, _hybrid_reference

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

KINDS = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_fp32_greedy_parity_on_gpu(tiny_hybrid_models, kind, enforce_eager):
    expected, _ = _hybrid_reference(tiny_hybrid_models[kind], PROMPTS)
    llm = LLM(
        str(tiny_hybrid_models[kind]),
        dtype="float32",
        device="cuda",
        num_gpu_blocks_override=256,
        enforce_eager=enforce_eager,
        max_num_batched_tokens=24,  # chunked prefill: state carried across chunks
        max_num_seqs=16,
    )
    assert llm.engine.async_scheduling
    assert atom_greedy(llm, PROMPTS, MAX_TOKENS) == expected


def test_cuda_graph_replay_with_reused_slots_gives_eager_tokens(tiny_hybrid_models):
    # 13 prompts through 4 slots: slots are reused many times, graphs padded (rows of slot -1).
    prompts = random_prompts(5, [3, 9, 14, 33, 2, 7, 61, 18, 5, 40, 11, 27, 8])
    kw = dict(dtype="float32", device="cuda", num_gpu_blocks_override=512, max_num_seqs=4)
    eager = LLM(str(tiny_hybrid_models["qwen3_next"]), enforce_eager=True, **kw)
    graphs = LLM(str(tiny_hybrid_models["qwen3_next"]), enforce_eager=False, **kw)
    assert graphs.engine.executor.graphs, "no CUDA graph was captured"
    assert atom_greedy(graphs, prompts, 24) == atom_greedy(eager, prompts, 24)


def test_bf16_dummy_qwen3_5_4b_shape_starts_and_serves():
    llm = LLM(
        "benchmarks/configs/qwen3.5-4b",
        load_format="dummy",
        max_num_seqs=64,
        gpu_memory_utilization=0.5,
    )
    pool = llm.engine.state_pool
    assert pool.num_slots == 64  # 64 x 49 MiB fit easily next to an 8 GiB model
    assert llm.engine.executor.state_bytes_per_slot == 24 * (8192 * 3 * 2 + 32 * 128 * 128 * 4)
    outs = atom_greedy(llm, random_prompts(1, [500, 37, 1200, 3]), 32)
    assert [len(o) for o in outs] == [32] * 4
    assert pool.num_in_use == 0

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


def test_wide_gdn_decode_gives_the_tokens_of_the_split_kernel_and_transformers(
    tiny_hybrid_models, monkeypatch
):
    """150 sequences of 2 k heads fill an H200 (150 x 2 programs > 2 x 132), so decode steps
    take the wide GDN kernel: greedy tokens (fp32, CUDA graphs) equal those of gdn_decode.py's
    kernel (ATOM_GDN_DECODE=split) for all, and transformers' for the parity prompts."""
    from atom_kernels import gdn_decode_wide

    folder = tiny_hybrid_models["qwen3_next"]
    expected, _ = _hybrid_reference(folder, PROMPTS)
    prompts = PROMPTS + random_prompts(9, [3 + i % 40 for i in range(145)])
    kw = dict(dtype="float32", device="cuda", num_gpu_blocks_override=2048, max_num_seqs=160)
    tokens = {}
    for path in ("split", "auto"):
        monkeypatch.setattr(gdn_decode_wide, "DECODE_PATH", path)
        llm = LLM(str(folder), **kw)
        tokens[path] = atom_greedy(llm, prompts, 12)
        llm.shutdown()
    assert tokens["auto"] == tokens["split"]
    assert [t[:MAX_TOKENS] for t in tokens["auto"][: len(PROMPTS)]] == expected


def test_bf16_state_qwen3_5_4b_shape_times_its_decode_kernel_and_serves():
    """A bf16 recurrent state: half the recurrent bytes a slot, the GDN decode launch timed at
    start-up for that dtype (64 rows fill an H200), a batch served."""
    import torch

    from atom_kernels import gdn_decode_wide

    llm = LLM(
        "benchmarks/configs/qwen3.5-4b",
        load_format="dummy",
        max_num_seqs=64,
        gpu_memory_utilization=0.5,
        mamba_ssm_cache_dtype="bfloat16",
    )
    assert llm.engine.executor.state_bytes_per_slot == 24 * (8192 * 3 * 2 + 32 * 128 * 128 * 2)
    layer = gdn_decode_wide.layer_key(16, 32, 128, 128, torch.bfloat16)
    assert layer in gdn_decode_wide._launch_shapes  # the start-up timing chose for it
    outs = atom_greedy(llm, random_prompts(2, [700, 12] * 20), 16)
    assert [len(o) for o in outs] == [16] * 40
    assert llm.engine.state_pool.num_in_use == 0

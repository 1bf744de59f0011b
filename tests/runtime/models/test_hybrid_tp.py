"""Tensor parallelism for hybrid models on CPU: 2 ranks over gloo (rank 1 a worker process).

Each rank holds half of the attention heads, half of the Gated DeltaNet key/value heads (and so
half of every state slot) and half of every expert's intermediate dimension; greedy tokens must
be those of one rank, also when chunked prefill carries the state across chunks.
"""

from __future__ import annotations

import multiprocessing
import random

import pytest

from atom_runtime import LLM, SamplingParams
from atom_runtime.system import distributed

pytestmark = pytest.mark.timeout(300)


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in lengths]


PROMPTS = _prompts(0, [1, 5, 17, 40, 97])


def _run(folder, tp: int, **kwargs) -> tuple[list[list[int]], int]:
    llm = LLM(
        str(folder),
        dtype="float32",
        device="cpu",
        tensor_parallel_size=tp,
        num_gpu_blocks_override=64,
        **kwargs,
    )
    try:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.engine.executor.state_bytes_per_slot
    finally:
        llm.shutdown()


@pytest.fixture(autouse=True)
def _no_leftover_workers():
    before = set(multiprocessing.active_children())
    yield
    assert set(multiprocessing.active_children()) - before == set()
    assert distributed.tp_size() == 1


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5"])
def test_tp2_greedy_tokens_equal_one_rank_with_half_the_state(tiny_hybrid_models, kind):
    kwargs = dict(max_num_batched_tokens=24, max_num_seqs=4)
    one, one_bytes = _run(tiny_hybrid_models[kind], 1, **kwargs)
    two, two_bytes = _run(tiny_hybrid_models[kind], 2, **kwargs)
    assert two == one
    assert two_bytes * 2 == one_bytes  # each rank keeps the state of its own heads

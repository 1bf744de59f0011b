"""Tensor parallelism for hybrid models on CPU: 2 ranks over gloo (rank 1 a worker process).

Each rank holds half of the attention heads, half of the Gated DeltaNet key/value heads (and so
half of every state slot) and half of every expert's intermediate dimension; greedy tokens must
be those of one rank, also when chunked prefill carries the state across chunks.
"""

from __future__ import annotations

import pytest

from atom_runtime import LLM
from tests.hf_reference import atom_greedy, random_prompts

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("no_leftover_tp_workers")]


PROMPTS = random_prompts(0, [1, 5, 17, 40, 97])


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
        return atom_greedy(llm, PROMPTS, 8), llm.engine.executor.state_bytes_per_slot
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5"])
def test_tp2_greedy_tokens_equal_one_rank_with_half_the_state(tiny_hybrid_models, kind):
    kwargs = dict(max_num_batched_tokens=24, max_num_seqs=4)
    one, one_bytes = _run(tiny_hybrid_models[kind], 1, **kwargs)
    two, two_bytes = _run(tiny_hybrid_models[kind], 2, **kwargs)
    assert two == one
    assert two_bytes * 2 == one_bytes  # each rank keeps the state of its own heads

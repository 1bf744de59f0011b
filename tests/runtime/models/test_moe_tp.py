"""Tensor parallelism for the sparse-MoE families on CPU: 2 ranks over gloo (rank 1 a worker
process). Each rank holds half of the attention heads (GPT-OSS: half of the sinks), half of
every expert's intermediate dimension (GPT-OSS: its half of the interleaved gate/up rows and
their biases; the down bias is added once), and the router whole; greedy tokens must be those
of one rank, with chunked prefill and the window layers' own blocks (GPT-OSS)."""

from __future__ import annotations

import pytest

from atom_runtime import LLM
from tests.hf_reference import atom_greedy, random_prompts
from tests.model_factory import make_tiny_model

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("no_leftover_tp_workers")]

PROMPTS = random_prompts(0, [1, 5, 17, 40, 97])
# Head counts two ranks can split (the parity configs keep odd ones).
EVEN_HEADS = {
    "qwen3_moe": {"num_key_value_heads": 2},
    "mixtral": {"num_attention_heads": 4},
    "gpt_oss": {},
}


def _run(folder, tp: int) -> list[list[int]]:
    llm = LLM(
        str(folder), dtype="float32", device="cpu", tensor_parallel_size=tp,
        num_gpu_blocks_override=64, max_num_batched_tokens=24, max_num_seqs=4,
    )  # fmt: skip
    try:
        return atom_greedy(llm, PROMPTS, 8)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kind", list(EVEN_HEADS))
def test_tp2_greedy_tokens_equal_one_rank(tmp_path, kind):
    folder = make_tiny_model(tmp_path / kind, kind, **EVEN_HEADS[kind])
    assert _run(folder, 2) == _run(folder, 1)

"""DeepSeek models on a GPU: greedy parity with transformers in fp32 (Triton cache write and
absorbed decode, SDPA prefill), eager and with CUDA graphs for decode and short prefill/mixed
steps; and a bf16 dummy-weight engine of DeepSeek-V3's real dimensions (4 of its layers: three
dense, one with 256 experts) sizing its latent cache and serving prompts long enough to take
the up-projected prefill path."""

from __future__ import annotations

import json

import pytest

from atom_runtime import LLM
from tests.hf_reference import atom_greedy, random_prompts
from tests.runtime.models.test_mla import PROMPTS, _hf_reference

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]


@pytest.mark.parametrize("kind", ["deepseek_v3", "deepseek_v2"])
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_fp32_greedy_parity_on_gpu(tiny_mla_models, kind, enforce_eager):
    expected, _ = _hf_reference(tiny_mla_models[kind], PROMPTS)
    llm = LLM(
        str(tiny_mla_models[kind]), dtype="float32", device="cuda", num_gpu_blocks_override=256,
        enforce_eager=enforce_eager, max_num_batched_tokens=24, max_num_seqs=16,
    )  # fmt: skip
    if not enforce_eager:
        assert llm.engine.executor.graphs, "no decode CUDA graph was captured"
    assert atom_greedy(llm, PROMPTS, 8) == expected


def test_graph_replay_gives_eager_tokens_on_many_short_steps(tiny_mla_models):
    prompts = random_prompts(5, [3, 9, 14, 33, 2, 7, 61, 18, 5, 40, 11, 27, 8])
    kw = dict(dtype="float32", device="cuda", num_gpu_blocks_override=512, max_num_seqs=4)
    folder = str(tiny_mla_models["deepseek_v3"])
    eager = atom_greedy(LLM(folder, enforce_eager=True, **kw), prompts, 24)
    graphs = LLM(folder, enforce_eager=False, **kw)
    assert atom_greedy(graphs, prompts, 24) == eager
    assert graphs.engine.executor.prefill_graphs.replays > 0


def test_bf16_dummy_deepseek_v3_dims_start_and_serve(tmp_path):
    cfg = json.loads(open("benchmarks/configs/deepseek-v3-8l/config.json").read())
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"num_hidden_layers": 4}))
    llm = LLM(str(tmp_path), load_format="dummy", max_num_seqs=32, gpu_memory_utilization=0.6)
    runner = llm.engine.executor
    assert runner.bytes_per_block == 4 * 16 * 576 * 2  # layers x block x latent row x bf16
    cache = runner.model.attention_layers()[0].cache_tensors()
    assert len(cache) == 1 and tuple(cache[0].shape[1:]) == (16, 576)
    outs = atom_greedy(llm, random_prompts(1, [2000, 37, 700, 3]), max_tokens=16)
    assert [len(o) for o in outs] == [16] * 4

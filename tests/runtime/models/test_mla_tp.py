"""Tensor parallelism for DeepSeek (multi-head latent attention) on CPU: 2 ranks over gloo (rank 1
a worker process).

Each rank holds half of the heads (q_b_proj / q_proj and kv_b_proj rows, o_proj columns) and half
of every expert's and the shared experts' intermediate dimension, and the whole latent cache (one
row a token, not per head: replicated). Greedy tokens with TP=2 are transformers' (and one
rank's), also when chunked prefill mixes absorbed and up-projected chunks with decodes.
"""

from __future__ import annotations

import pytest
import torch

from atom_runtime import LLM
from atom_runtime.models.config import ModelConfig
from atom_runtime.models.loader import build_model
from atom_runtime.system import distributed
from tests.hf_reference import atom_greedy, random_prompts
from tests.model_factory import make_tiny_model
from tests.runtime.models.test_mla import _hf_reference

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("no_leftover_tp_workers")]

PROMPTS = random_prompts(0, [1, 5, 17, 40, 97])


@pytest.fixture(scope="module")
def tp_models(tmp_path_factory):
    """Four heads (two a rank): V3 with rope over halves instead of interleaved pairs, and the
    V2-Lite shape (no q_lora)."""
    root = tmp_path_factory.mktemp("mla_tp")
    return {
        "deepseek_v3": make_tiny_model(
            root / "v3", "deepseek_v3", num_attention_heads=4, num_key_value_heads=4,
            rope_interleave=False,
        ),
        "deepseek_v2": make_tiny_model(
            root / "v2", "deepseek_v2", num_attention_heads=4, num_key_value_heads=4,
            hidden_size=64,
        ),
    }  # fmt: skip


def _run(folder, tp: int) -> tuple[list[list[int]], int]:
    llm = LLM(
        str(folder), dtype="float32", device="cpu", tensor_parallel_size=tp,
        num_gpu_blocks_override=64, max_num_batched_tokens=24, max_num_seqs=4,
    )  # fmt: skip
    try:
        runner = getattr(llm.engine.executor, "runner", llm.engine.executor)  # rank 0's
        return atom_greedy(llm, PROMPTS, 8), runner.bytes_per_block
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kind", ["deepseek_v3", "deepseek_v2"])
def test_tp2_greedy_tokens_equal_transformers_with_the_whole_latent_cache(tp_models, kind):
    expected, _ = _hf_reference(tp_models[kind], PROMPTS)
    one, one_bytes = _run(tp_models[kind], 1)
    two, two_bytes = _run(tp_models[kind], 2)
    assert one == expected
    assert two == expected
    assert two_bytes == one_bytes  # the latent cache is replicated, not split


def test_each_rank_holds_half_the_heads_and_experts(tp_models, monkeypatch):
    folder = tp_models["deepseek_v3"]
    cfg = ModelConfig.from_file(folder)

    def load(rank: int, world: int) -> dict[str, torch.Tensor]:
        monkeypatch.setattr(distributed, "_rank", rank)
        monkeypatch.setattr(distributed, "_world_size", world)
        model = build_model(folder, cfg, "auto", torch.float32, torch.device("cpu"))
        layers = model.attention_layers()
        assert all(layer.num_heads == 4 // world for layer in layers)
        assert all(layer.cache_spec().tensors[0].token_shape == (52,) for layer in layers)
        return dict(model.named_parameters())

    full = load(0, 1)
    shards = [load(0, 2), load(1, 2)]
    attn = "model.layers.1.self_attn."
    for name, dim in (("q_b_proj.weight", 0), ("kv_b_proj.weight", 0), ("o_proj.weight", 1)):
        joined = torch.cat([s[attn + name] for s in shards], dim=dim)
        assert torch.equal(joined, full[attn + name]), name
    for s in shards:  # replicated: the latent projection, its norm, the router
        for name in (attn + "fused_qkv_a_proj.weight", attn + "kv_a_layernorm.weight",
                     "model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias"):  # fmt: skip
            assert torch.equal(s[name], full[name]), name
    w2 = "model.layers.2.mlp.w2"  # [experts, hidden, intermediate]: columns split
    assert torch.equal(torch.cat([s[w2] for s in shards], dim=2), full[w2])
    shared_down = "model.layers.2.mlp.shared_experts.down_proj.weight"
    assert torch.equal(torch.cat([s[shared_down] for s in shards], dim=1), full[shared_down])

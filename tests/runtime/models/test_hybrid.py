"""Hybrid models (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) against transformers, fp32 on CPU, and their
state slots.

Pinned: greedy tokens identical to `transformers.generate` for a batch of very different prompt
lengths under a token budget that cuts the long prompts into chunks (state carried across
chunks), first-step logprobs close; the same under async scheduling and under a KV pool so small
that sequences are preempted (state rebuilt by recompute); a request placed in a slot that still
holds another request's state gives the tokens of a fresh engine; a waiting request gets a slot
once one is returned; slot sizing caps max_num_seqs, and no room for a slot is a start-up error
naming --gpu-memory-utilization; configs the engine cannot serve are refused naming the field.
"""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from atom_runtime import LLM, SamplingParams
from atom_runtime.config import EngineConfig
from atom_runtime.core.batch import StepOutput
from atom_runtime.core.block_manager import BlockManager
from atom_runtime.core.block_pool import BlockPool
from atom_runtime.core.scheduler import Scheduler
from atom_runtime.core.sequence import FinishReason, Sequence
from atom_runtime.engine.core import _warn_checkpoint_flags
from atom_runtime.models.config import ModelConfig
from atom_runtime.state.slot_pool import StateSlotPool, plan_state_slots
from tests.hf_reference import hf_greedy, random_prompts
from tests.model_factory import hybrid_references_on_torch

KINDS = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]
MAX_TOKENS = 8

pytestmark = pytest.mark.timeout(300)


PROMPTS = random_prompts(0, [1, 5, 17, 40, 97])
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _hybrid_reference(folder, prompts):
    """Greedy tokens and the first step's log-softmax, per prompt, from transformers' pure-torch
    Gated DeltaNet."""
    hybrid_references_on_torch()
    return hf_greedy(folder, prompts, MAX_TOKENS, first_logprobs=True)


@pytest.fixture(scope="module")
def references(tiny_hybrid_models):
    return {kind: _hybrid_reference(tiny_hybrid_models[kind], PROMPTS) for kind in KINDS}


def _greedy(llm: LLM, prompts, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def _assert_slots_returned(llm: LLM) -> None:
    pool = llm.engine.state_pool
    assert pool is not None and pool.num_in_use == 0


# -- parity ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_tokens_and_logprobs_match_transformers_under_chunked_prefill(
    tiny_hybrid_models, references, kind
):
    expected, first = references[kind]
    # A 24-token budget cuts the 40- and 97-token prompts into chunks that share steps with
    # the other sequences' decodes: their state must carry over from chunk to chunk.
    llm = LLM(
        str(tiny_hybrid_models[kind]),
        dtype="float32",
        num_gpu_blocks_override=64,
        max_num_batched_tokens=24,
        max_num_seqs=8,
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)
    outs = _greedy(llm, PROMPTS, params)
    assert [o.token_ids for o in outs] == expected
    for out, ref in zip(outs, first, strict=True):
        for token, lp in out.logprobs[0].items():
            assert lp == pytest.approx(ref[token].item(), abs=1e-4)
    _assert_slots_returned(llm)


def test_async_scheduling_matches_transformers(tiny_hybrid_models, references):
    expected, _ = references["qwen3_5"]
    llm = LLM(
        str(tiny_hybrid_models["qwen3_5"]),
        dtype="float32",
        num_gpu_blocks_override=64,
        max_num_batched_tokens=24,
        async_scheduling=True,
    )
    assert [o.token_ids for o in _greedy(llm, PROMPTS)] == expected
    _assert_slots_returned(llm)


def test_preemption_under_a_small_kv_pool_rebuilds_state(tiny_hybrid_models):
    folder = tiny_hybrid_models["qwen3_next"]
    prompts = random_prompts(7, [28, 30, 31, 14])
    expected, _ = _hybrid_reference(folder, prompts)
    # 7 blocks of 16 tokens hold the four prompts (2 + 2 + 2 + 1) but not their growth: the
    # tail is preempted, loses its slot, and recomputes its state from token 0 when readmitted.
    llm = LLM(str(folder), dtype="float32", num_gpu_blocks_override=7, max_model_len=112)
    assert [o.token_ids for o in _greedy(llm, prompts)] == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.pool.num_free_blocks == 7
    _assert_slots_returned(llm)


def test_reused_slot_gives_the_tokens_of_a_fresh_engine(tiny_hybrid_models, references):
    folder = tiny_hybrid_models["qwen3_5_moe"]
    expected, _ = references["qwen3_5_moe"]
    # One slot: the second request runs in the slot the first one just left.
    llm = LLM(str(folder), dtype="float32", num_gpu_blocks_override=64, max_num_seqs=1)
    assert llm.engine.state_pool.num_slots == 1
    first = _greedy(llm, [PROMPTS[4]])[0].token_ids
    layers = llm.engine.executor.state.layers
    # The slot still holds the first request's state (nothing zeroes it on release) ...
    assert all(layer.ssm_state[0].abs().sum() > 0 for layer in layers)
    assert all(layer.conv_state[0].abs().sum() > 0 for layer in layers)
    second = _greedy(llm, [PROMPTS[2]])[0].token_ids
    fresh = LLM(str(folder), dtype="float32", num_gpu_blocks_override=64, max_num_seqs=1)
    # ... yet the second request's tokens are those of a fresh engine and of transformers.
    assert second == _greedy(fresh, [PROMPTS[2]])[0].token_ids == expected[2]
    assert first == expected[4]


_TRITON_RUN = """
import json, sys
from atom_runtime import LLM, SamplingParams
from atom_kernels import ops
import torch
assert ops.backend_for(torch.zeros(1)) == "triton"
prompts = json.loads(sys.argv[2])
llm = LLM(sys.argv[1], dtype="float32", num_gpu_blocks_override=32, max_num_batched_tokens=40)
params = SamplingParams(temperature=0, max_tokens=int(sys.argv[3]), ignore_eos=True)
outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
print(json.dumps([o.outputs[0].token_ids for o in outs]))
"""


@pytest.mark.parametrize("moe_gemv", [False, True])
def test_triton_kernels_in_the_model_match_transformers(tiny_hybrid_models, references, moe_gemv):
    """The whole engine on the Triton kernels (GDN, causal conv, gated norm, router top-k and
    fused MoE with the shared expert stacked, paged attention), run by the interpreter on CPU
    in fp32: the GPU code path, prompts chunked. With ATOM_MOE_GEMV=1 one request alone, so its
    decode steps take the pair GEMV."""
    import subprocess
    import sys

    expected, _ = references["qwen3_next"]
    picked = [3] if moe_gemv else [1, 3]  # 5 + 40 tokens over a 40-token budget: chunked
    prompts = [PROMPTS[i] for i in picked]
    env = {**os.environ, "TRITON_INTERPRET": "1", "ATOM_KERNEL_BACKEND": "triton"}
    env["ATOM_MOE_GEMV"] = "1" if moe_gemv else "0"
    run = subprocess.run(
        [sys.executable, "-c", _TRITON_RUN, str(tiny_hybrid_models["qwen3_next"]),
         json.dumps(prompts), str(MAX_TOKENS)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == [expected[i] for i in picked]


def test_dummy_weights_generate(tiny_hybrid_models):
    llm = LLM(str(tiny_hybrid_models["qwen3_5_moe"]), load_format="dummy", max_num_seqs=4)
    outs = _greedy(llm, PROMPTS[:3])
    assert [len(o.token_ids) for o in outs] == [MAX_TOKENS] * 3


def test_multimodal_sharded_checkpoint_loads_the_language_model(tiny_hybrid_models, tmp_path):
    """Qwen3.5 releases: `model.language_model.` names, a vision tower and an MTP head to skip,
    a nested text_config, weights sharded over several files."""
    src = tiny_hybrid_models["qwen3_5"]
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    renamed = {k.replace("model.", "model.language_model.", 1): v for k, v in tensors.items()}
    renamed["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(4, 4)
    renamed["mtp.fc.weight"] = torch.zeros(4, 4)
    names = sorted(renamed)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: renamed[k].contiguous() for k in keys}, str(tmp_path / file))
        weight_map.update(dict.fromkeys(keys, file))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    text = json.loads((src / "config.json").read_text())
    top = {"model_type": "qwen3_5", "text_config": text, "vision_config": {"depth": 1}}
    top["architectures"] = ["Qwen3_5ForConditionalGeneration"]
    (tmp_path / "config.json").write_text(json.dumps(top))
    prompts = PROMPTS[2:4]
    got = [o.token_ids for o in _greedy(LLM(str(tmp_path), dtype="float32"), prompts)]
    want = [o.token_ids for o in _greedy(LLM(str(src), dtype="float32"), prompts)]
    assert got == want


def test_stacked_shared_expert_loads_whole_or_the_start_names_what_is_missing(
    tiny_hybrid_models, tmp_path
):
    """qwen3_next's shared expert is as wide as a routed one, so the engine stacks it after the
    experts with its gate as the router's last row; a checkpoint without one of those tensors
    is refused naming it (its parameters count as loaded after any one of their parts)."""
    import shutil

    src = tiny_hybrid_models["qwen3_next"]
    llm = LLM(str(src), dtype="float32", num_gpu_blocks_override=32)
    try:
        moe = llm.engine.executor.model.model.layers[0].mlp
        assert moe.stacked_shared and moe.shared_expert is None
        assert moe.w13.shape[0] == moe.num_experts + 1 == moe.gate.weight.shape[0]
    finally:
        llm.shutdown()
    for file in src.iterdir():
        if file.name != "model.safetensors":
            shutil.copy(file, tmp_path / file.name)
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    gone = "model.layers.2.mlp.shared_expert_gate.weight"
    del tensors[gone]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="checkpoint is missing tensors") as exc:
        LLM(str(tmp_path), dtype="float32", num_gpu_blocks_override=32)
    assert gone in str(exc.value)


# -- state slots -------------------------------------------------------------------------------------


def test_slot_pool_hands_out_distinct_slots_and_takes_them_back():
    pool = StateSlotPool(5, slots_per_request=2)
    a, b, c = (Sequence(r, [1, 2], GREEDY) for r in "abc")
    assert pool.allocate(a) and pool.allocate(b)
    assert len(set(a.state_slots + b.state_slots)) == 4
    assert not pool.allocate(c) and c.state_slots == [] and pool.num_free == 1
    pool.free(a)
    pool.free(a)  # idempotent
    assert pool.allocate(c) and pool.num_in_use == 4
    with pytest.raises(ValueError, match="slots_per_request"):
        StateSlotPool(1, slots_per_request=2)


def _scheduler(num_slots: int) -> Scheduler:
    blocks = BlockManager(BlockPool(64, 16), enable_prefix_caching=False)
    return Scheduler(
        blocks, 8, 64, max_model_len=256, eos_token_ids=[], state_pool=StateSlotPool(num_slots)
    )


def test_a_request_waits_for_a_slot_and_gets_the_one_returned():
    sched = _scheduler(1)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    a, b = Sequence("a", [1] * 5, one), Sequence("b", [2] * 5, one)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert batch.seqs == [a] and list(sched.waiting) == [b]
    slot = a.state_slots[0]
    sched.commit(batch, [a])
    assert sched.schedule().seqs == []  # b still waits for a slot; a's token is in flight
    _, finished = sched.update_from_output(batch, StepOutput([a], [7]))
    assert finished == [a] and a.finish_reason is FinishReason.LENGTH
    assert a.state_slots == []
    assert sched.schedule().seqs == [b] and b.state_slots == [slot]


def test_abort_and_preemption_return_slots():
    sched = _scheduler(2)
    a, b = Sequence("a", [1] * 5, GREEDY), Sequence("b", [2] * 5, GREEDY)
    sched.add(a)
    sched.add(b)
    sched.schedule()
    assert sched.state_pool.num_in_use == 2
    sched.abort({"a"})
    assert a.state_slots == [] and sched.state_pool.num_in_use == 1
    sched._preempt(sched.running.pop())
    assert b.state_slots == [] and sched.state_pool.num_in_use == 0
    assert sched.schedule().seqs == [b] and b.num_computed_tokens == 0


def test_no_room_for_a_slot_names_gpu_memory_utilization(tiny_hybrid_models, monkeypatch):
    with pytest.raises(RuntimeError, match="--gpu-memory-utilization"):
        plan_state_slots(1000, bytes_per_slot=4096, bytes_per_block=512, max_num_seqs=8)
    monkeypatch.setenv("ATOM_CPU_KVCACHE_SPACE", "0.000001")  # ~1 KiB
    with pytest.raises(RuntimeError, match="--gpu-memory-utilization"):
        LLM(str(tiny_hybrid_models["qwen3_5"]), dtype="float32")


def _slot_bytes(cfg: ModelConfig) -> int:
    """fp32 model: conv state [2K + V, W-1] and recurrent state [Hv, Dk, Dv] per GDN layer."""
    k = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    v = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    conv = (2 * k + v) * (cfg.linear_conv_kernel_dim - 1)
    ssm = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    return 4 * (conv + ssm) * cfg.layer_types.count("linear_attention")


def test_max_num_seqs_is_capped_to_the_slots_that_fit(tiny_hybrid_models, monkeypatch, caplog):
    folder = tiny_hybrid_models["qwen3_5"]
    per_slot = _slot_bytes(ModelConfig.from_file(folder))
    # Room for 3 slots in half the budget: the state takes at most half of it.
    monkeypatch.setenv("ATOM_CPU_KVCACHE_SPACE", str(2 * 3.5 * per_slot / 2**30))
    with caplog.at_level(logging.WARNING):
        llm = LLM(str(folder), dtype="float32", max_num_seqs=8)
    assert llm.engine.executor.state_bytes_per_slot == per_slot
    assert llm.engine.state_pool.num_slots == 3
    assert llm.engine.config.max_num_seqs == 3
    assert "max_num_seqs capped from 8 to 3" in caplog.text
    stats = llm.engine.stats()
    assert (stats.state_slots_total, stats.state_slot_bytes) == (3, per_slot)
    outs = _greedy(llm, PROMPTS)  # 5 requests through 3 slots
    assert all(len(o.token_ids) == MAX_TOKENS for o in outs)


def test_prefix_caching_is_off_for_hybrid_models_without_checkpoints(tiny_hybrid_models, caplog):
    with caplog.at_level(logging.INFO):
        llm = LLM(
            str(tiny_hybrid_models["qwen3_5"]),
            dtype="float32",
            num_gpu_blocks_override=32,
            state_checkpoint_interval_tokens=0,
        )
    assert "prefix reuse for hybrid models needs state checkpoints" in caplog.text
    assert llm.engine.checkpoints is None
    prompt = random_prompts(5, [40])[0]
    _greedy(llm, [prompt])
    again = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0 and llm.engine.pool.cached == {}


# -- refusals and warnings ---------------------------------------------------------------------------


def _hybrid_config(**changes) -> dict:
    from tests.model_factory import HYBRID_CONFIGS

    cfg = dict(HYBRID_CONFIGS["qwen3_next"], vocab_size=128)
    cfg.update(changes)
    return cfg


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        (
            {"layer_types": ["linear_attention", "sliding_attention", "full_attention"]},
            "layer_types",
        ),
        ({"layer_types": ["full_attention"]}, "layer_types"),
        ({"layer_types": ["linear_attention"] * 3}, "layer_types"),
        ({"full_attention_interval": 0}, "full_attention_interval"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
        ({"linear_key_head_dim": None}, "linear_key_head_dim"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        (
            {"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.0625}},
            "partial_rotary_factor",
        ),
    ],
)
def test_unservable_configs_are_refused_naming_the_field(changes, field):
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf(_hybrid_config(**changes))


def test_nested_qwen3_5_config_reads_its_text_config():
    from tests.model_factory import HYBRID_CONFIGS

    text = dict(HYBRID_CONFIGS["qwen3_5"], vocab_size=128, num_hidden_layers=8)
    text.pop("full_attention_interval")
    cfg = ModelConfig.from_hf({"model_type": "qwen3_5", "text_config": text})
    assert cfg.is_hybrid and cfg.num_experts == 0 and cfg.rotary_dim == 4
    assert cfg.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 2


def test_checkpoint_flags_warn_without_effect_for_non_hybrid_models(caplog):
    with caplog.at_level(logging.WARNING):
        _warn_checkpoint_flags(EngineConfig(state_checkpoint_interval_tokens=64), hybrid=False)
    assert "--state-checkpoint-interval-tokens=64 has no effect" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        config = EngineConfig(state_checkpoint_memory_fraction=0.25)
        _warn_checkpoint_flags(config, hybrid=False)
    assert "--state-checkpoint-memory-fraction=0.25 has no effect" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        _warn_checkpoint_flags(EngineConfig(), hybrid=False)
    assert caplog.text == ""

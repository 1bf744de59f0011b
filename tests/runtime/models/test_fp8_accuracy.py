"""FP8 accuracy against transformers (fp32, CPU) on the dequantized weights, teacher-forced.

Each FP8 checkpoint (tests/fp8_checkpoints.py: block-scaled `fp8` with `weight_scale_inv`,
compressed-tensors per channel with `weight_scale`, compressed-tensors per tensor with a static
`input_scale`) has a twin holding the same weights dequantized. Two ways to run it here:

- as the CPU engine does (no FP8 GEMM on a CPU): dequantized at load. The engine's weights are
  then the twin's, so every prediction agrees and the log-probabilities match to fp32 noise.
- natively (FP8 weights and scales in memory, `runs_natively` forced true): the FP8 ops run
  their torch references, which compute what the GPU kernels compute (activations quantized per
  token or per 32-column group for W8A8, the batch-1 GEMV on FP8 weights with x unquantized).
  The activations' FP8 rounding moves each log-probability by ~0.03 on average (at most ~0.15
  on the dense models, ~0.5 on the tiny DeepSeek): on these random models, whose vocabulary of
  49k is spread by a 64-wide hidden state, many top-2 pairs are that close, so 15-25% of
  predictions flip while every clear call (a lead over CLEAR_MARGIN) holds. That is why the
  comparison is teacher-forced (the engine's own sequences scored by both: one flip does not
  derail what follows) and not greedy continuations.

The same holds for `--quantization fp8` (per-channel weights quantized at load; its twin is the
bf16 checkpoint quantized the same way) and for `--kv-cache-dtype fp8` (K and V rounded to FP8
in the cache with scale 1.0: ~0.02 nats on average, ~10% of near-ties flip).
"""

from __future__ import annotations

import logging

import pytest
import torch

from atom_kernels.fp8_formats import is_fp8
from atom_runtime import LLM, SamplingParams
from atom_runtime.layers import fp8_linear
from atom_runtime.layers.linear import LinearBase
from tests.fp8_checkpoints import teacher_forced, write_fp8_checkpoint, write_online_twin
from tests.hf_reference import random_prompts

PROMPTS = random_prompts(7, [9, 23, 40])
MAX_TOKENS = 8
# Native FP8 against the dequantized twin: the bounds these tiny models meet with margin.
NATIVE = {"agreement": 0.7, "mean_err": 0.06, "max_err": 0.3}
KV_FP8 = {"agreement": 0.8, "mean_err": 0.04, "max_err": 0.2}


@pytest.fixture(scope="module")
def checkpoints(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    return {
        ("llama", "block"): write_fp8_checkpoint(tiny_models["llama"], root / "llama", "block"),
        ("qwen3", "channel"): write_fp8_checkpoint(tiny_models["qwen3"], root / "qwen3", "channel"),
        ("llama", "tensor"): write_fp8_checkpoint(tiny_models["llama"], root / "llama", "tensor"),
    }


def _fp8_layers(llm: LLM) -> list[LinearBase]:
    model = llm.engine.executor.model
    return [m for m in model.modules() if isinstance(m, LinearBase) and is_fp8(m.weight)]


def _check(result: dict, bounds: dict) -> None:
    assert result["agreement"] >= bounds["agreement"], result
    assert result["clear_agreement"] == 1.0, result
    assert result["mean_err"] <= bounds["mean_err"] and result["max_err"] <= bounds["max_err"], (
        result
    )


@pytest.mark.parametrize("key", [("llama", "block"), ("qwen3", "channel"), ("llama", "tensor")])
def test_on_cpu_fp8_checkpoints_are_dequantized_and_equal_their_twin(checkpoints, key, caplog):
    fp8_dir, twin = checkpoints[key]
    with caplog.at_level(logging.WARNING, logger="atom_runtime.models.fp8_loading"):
        llm = LLM(str(fp8_dir), dtype="float32", num_gpu_blocks_override=64)
    assert not _fp8_layers(llm)
    notices = [r.getMessage() for r in caplog.records if "dequantized" in r.getMessage()]
    assert len(notices) == 1 and "no FP8 GEMM on cpu" in notices[0]
    result = teacher_forced(llm, twin, PROMPTS, MAX_TOKENS)
    assert result["agreement"] == 1.0 and result["max_err"] < 1e-3, result


@pytest.mark.parametrize("key", [("llama", "block"), ("qwen3", "channel"), ("llama", "tensor")])
def test_native_fp8_checkpoints_agree_with_their_twin(checkpoints, key, monkeypatch):
    monkeypatch.setattr(fp8_linear, "runs_natively", lambda device: True)
    fp8_dir, twin = checkpoints[key]
    llm = LLM(str(fp8_dir), dtype="float32", num_gpu_blocks_override=64)
    layers = _fp8_layers(llm)
    assert len(layers) == 2 * 4  # qkv, o, gate_up, down in each of the 2 layers
    layout = key[1]
    for m in layers:
        assert m.weight.dtype == torch.float8_e4m3fn and m.weight_scale.dtype == torch.float32
        assert (m.weight_block_size == (32, 32)) == (layout == "block")
        assert (m.input_scale is not None) == (layout == "tensor")
    _check(teacher_forced(llm, twin, PROMPTS, MAX_TOKENS), NATIVE)


def test_online_fp8_agrees_with_the_per_channel_twin(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setattr(fp8_linear, "runs_natively", lambda device: True)
    twin = write_online_twin(tiny_models["qwen3"], tmp_path / "twin")
    llm = LLM(str(tiny_models["qwen3"]), dtype="float32", num_gpu_blocks_override=64,
              quantization="fp8")  # fmt: skip
    layers = _fp8_layers(llm)
    assert len(layers) == 8 and all(m.weight_scale.shape == (m.weight.shape[0],) for m in layers)
    _check(teacher_forced(llm, twin, PROMPTS, MAX_TOKENS), NATIVE)


def test_online_fp8_on_cpu_is_the_twin(tiny_models, tmp_path):
    twin = write_online_twin(tiny_models["llama"], tmp_path / "twin")
    llm = LLM(str(tiny_models["llama"]), dtype="float32", num_gpu_blocks_override=64,
              quantization="fp8")  # fmt: skip
    result = teacher_forced(llm, twin, PROMPTS, MAX_TOKENS)
    assert result["agreement"] == 1.0 and result["max_err"] < 1e-3, result


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("budget", [None, 7], ids=["whole", "chunked"])
def test_fp8_kv_cache_agrees_with_transformers(tiny_models, kind, budget):
    """Decode and paged prefill read K and V back from the FP8 cache (chunks of 7 tokens read
    the earlier chunks' FP8 rows)."""
    llm = LLM(str(tiny_models[kind]), dtype="float32", num_gpu_blocks_override=64,
              kv_cache_dtype="fp8", max_num_batched_tokens=budget)  # fmt: skip
    layers = llm.engine.executor.model.attention_layers()
    assert all(layer.k_cache.dtype == torch.float8_e4m3fn for layer in layers)
    _check(teacher_forced(llm, tiny_models[kind], PROMPTS, MAX_TOKENS), KV_FP8)


def test_fp8_kv_cache_with_prefix_hits_gives_what_it_gave_cold(tiny_models):
    shared = random_prompts(1, [48])[0]
    prompts = [shared + tail for tail in random_prompts(2, [3, 9])]
    llm = LLM(str(tiny_models["qwen3"]), dtype="float32", num_gpu_blocks_override=64,
              kv_cache_dtype="fp8")  # fmt: skip
    cold = teacher_forced(llm, tiny_models["qwen3"], prompts, MAX_TOKENS)
    warm = teacher_forced(llm, tiny_models["qwen3"], prompts, MAX_TOKENS)
    # The second run reads the shared blocks as the first run stored them (in FP8).
    assert warm == cold


@pytest.mark.parametrize("kind", ["deepseek_v3"])
def test_fp8_deepseek_with_its_experts_and_kv_b_proj_dequantized(
    tiny_mla_models, tmp_path, kind, monkeypatch, caplog
):
    """DeepSeek-V3's checkpoints are block FP8: every projection loads as FP8 but kv_b_proj
    (absorbed attention reads its parts) and the routed experts (no FP8 fused-MoE kernel), which
    are dequantized at load, each said in one notice; q_a / kv_a sit off the 32-row block grid
    here and are dequantized too."""
    monkeypatch.setattr(fp8_linear, "runs_natively", lambda device: True)
    fp8_dir, twin = write_fp8_checkpoint(tiny_mla_models[kind], tmp_path, "block")
    with caplog.at_level(logging.WARNING, logger="atom_runtime.models.fp8_loading"):
        llm = LLM(str(fp8_dir), dtype="float32", num_gpu_blocks_override=64)
    names = {n for n, m in llm.engine.executor.model.named_modules() if m in _fp8_layers(llm)}
    assert "model.layers.0.self_attn.o_proj" in names
    assert "model.layers.1.mlp.shared_experts.down_proj" in names
    assert not any("kv_b_proj" in n or "fused_qkv_a_proj" in n for n in names)
    expert_notes = [r for r in caplog.records if "MoE expert tensors dequantized" in r.getMessage()]
    assert len(expert_notes) == 1
    result = teacher_forced(llm, twin, PROMPTS, MAX_TOKENS)
    assert result["agreement"] >= 0.7 and result["clear_agreement"] == 1.0, result
    with pytest.raises(ValueError, match="kv_cache_dtype: 'fp8' is not supported for deepseek_v3"):
        LLM(str(fp8_dir), dtype="float32", num_gpu_blocks_override=64, kv_cache_dtype="fp8")


def test_fp8_hybrid_moe_loads_and_equals_its_twin_on_cpu(tiny_hybrid_models, tmp_path):
    """Qwen3-Next: FP8 attention and dense MLP projections, the GDN in_proj (its loader
    reorders rows) and the experts dequantized at load; on CPU all of it runs dequantized."""
    fp8_dir, twin = write_fp8_checkpoint(tiny_hybrid_models["qwen3_next"], tmp_path, "block", 16)
    llm = LLM(str(fp8_dir), dtype="float32", num_gpu_blocks_override=64)
    result = teacher_forced(llm, twin, PROMPTS, MAX_TOKENS)
    assert result["agreement"] == 1.0 and result["max_err"] < 1e-3, result


def test_checkpoint_kv_scales_reach_the_fp8_cache(checkpoints, tmp_path):
    """k/v cache scales as vLLM and llm-compressor write them (`self_attn.k_scale` /
    `v_scale`, one `kv_scale`) become the layers' scales when the cache is FP8, and the cache
    then holds K / k_scale: the same predictions as scale 1.0 within FP8 noise."""
    from safetensors.torch import load_file, save_file

    fp8_dir, twin = checkpoints[("llama", "block")]
    scaled = tmp_path / "scaled"
    scaled.mkdir()
    for f in fp8_dir.iterdir():
        if f.name != "model.safetensors":
            (scaled / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(fp8_dir / "model.safetensors"))
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor(0.25)
    tensors["model.layers.1.self_attn.kv_scale"] = torch.tensor(2.0)
    save_file(tensors, str(scaled / "model.safetensors"))
    llm = LLM(str(scaled), dtype="float32", num_gpu_blocks_override=64, kv_cache_dtype="fp8")
    layers = llm.engine.executor.model.attention_layers()
    assert [(a.k_scale, a.v_scale) for a in layers] == [(0.5, 0.25), (2.0, 2.0)]
    _check(teacher_forced(llm, twin, PROMPTS, MAX_TOKENS), KV_FP8)
    plain = LLM(str(scaled), dtype="float32", num_gpu_blocks_override=64)  # bf16 cache: unused
    assert [(a.k_scale, a.v_scale) for a in plain.engine.executor.model.attention_layers()] == [
        (1.0, 1.0),
        (1.0, 1.0),
    ]


@pytest.mark.parametrize(
    ("kind", "param"),
    [("qwen3_next", "fc.weight"), ("deepseek_v3", "model.layers.0.eh_proj.weight")],
)
def test_fp8_mtp_head_is_dequantized_and_is_its_twins_head(tmp_path, kind, param):
    """Qwen3-Next and DeepSeek-V3 FP8 checkpoints carry the MTP head in FP8 too (`mtp.*`,
    `model.layers.{num_hidden_layers}.*`, with their scales): it loads dequantized, the same
    head as the dequantized twin's, and with `--speculative-config mtp` the engine drafts and
    keeps greedy output."""
    from tests.model_factory import make_tiny_model

    src = make_tiny_model(tmp_path / "src", kind, mtp_layers=1)
    fp8_dir, twin = write_fp8_checkpoint(src, tmp_path, "block", 16)
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    runs = {}
    for name, folder in (("fp8", fp8_dir), ("twin", twin)):
        llm = LLM(str(folder), dtype="float32", num_gpu_blocks_override=64, speculative_config=spec)
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
            head = llm.engine.executor.drafter.head
            runs[name] = (
                [o.outputs[0].token_ids for o in outs],
                {n: p.detach().clone() for n, p in head.named_parameters()},
                llm.engine.scheduler.spec_stats.num_draft_tokens,
            )
        finally:
            llm.shutdown()
    (ids, head, drafts), (twin_ids, twin_head, _) = runs["fp8"], runs["twin"]
    assert ids == twin_ids and drafts > 0
    assert head.keys() == twin_head.keys() and param in head
    assert all(torch.equal(head[n], twin_head[n]) for n in head)


def _greedy_ids(llm: LLM, prompts: list[list[int]], max_tokens: int = 16) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_fp8_kv_cache_under_preemption_gives_what_an_ample_pool_gives(tiny_models):
    """Preempted sequences are recomputed into fresh FP8 blocks: the same K / k_scale rounding,
    so the same tokens as a pool where nothing is preempted."""
    # 9 blocks of 16 tokens cannot hold all six sequences at once.
    prompts = random_prompts(3, [1, 5, 16, 17, 40, 97])
    kw = dict(dtype="float32", kv_cache_dtype="fp8", max_model_len=120)
    ample = LLM(str(tiny_models["llama"]), num_gpu_blocks_override=64, **kw)
    want = _greedy_ids(ample, prompts, 10)
    llm = LLM(str(tiny_models["llama"]), num_gpu_blocks_override=9, **kw)
    assert _greedy_ids(llm, prompts, 10) == want
    assert llm.engine.scheduler.num_preemptions > 0


def test_fp8_kv_cache_on_a_hybrid_resumes_the_next_turn_from_state_checkpoints(
    tiny_hybrid_models,
):
    """Qwen3.5 with an FP8 KV cache: the state checkpoints' PAGE units are FP8 blocks (their
    size checked at start-up), and a second turn resumed from a checkpoint gives what a cold
    engine gives on the whole conversation."""
    folder = str(tiny_hybrid_models["qwen3_5"])
    # An image is ~4x the blocks of an fp32 cache's (a block is a quarter of the bytes): a
    # pool whose checkpoint share (a fraction of its blocks) holds a few of them.
    kw = dict(dtype="float32", kv_cache_dtype="fp8", num_gpu_blocks_override=256)
    first = [list(range(200, 243))]
    llm = LLM(folder, state_checkpoint_interval_tokens=16, **kw)
    turn1 = _greedy_ids(llm, first)[0]
    second = [first[0] + turn1 + [301, 302, 303]]
    got = _greedy_ids(llm, second)
    counters = llm.engine.checkpoints.counters
    assert counters.stored > 0 and counters.restored > 0
    assert got == _greedy_ids(LLM(folder, **kw), second)

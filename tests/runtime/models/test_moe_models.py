"""Sparse-MoE models (Qwen3-MoE, Mixtral, GPT-OSS) against transformers, fp32 on CPU.

Pinned: greedy tokens identical to `transformers.generate` and first-step logprobs close, for
prompts of very different lengths under a token budget that cuts the long ones into chunks
sharing steps with other sequences' decodes (mixed batches); the same tokens again from prefix
hits; under a KV pool small enough to preempt; the sliding window really shapes the answers
(without it transformers' own tokens differ); GPT-OSS's window layers give their blocks back
once the window has passed them; MXFP4 experts dequantize exactly as transformers does and serve
the tokens of the dequantized checkpoint; configs the engine cannot serve are refused naming
the field.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from atom_runtime import LLM, SamplingParams
from atom_runtime.models.config import ModelConfig
from atom_runtime.models.mxfp4 import dequantize_mxfp4
from atom_runtime.protocol.engine_core import EngineRequest
from tests.hf_reference import atom_greedy, hf_greedy, random_prompts
from tests.model_factory import MOE_CONFIGS, make_tiny_model

KINDS = ["qwen3_moe", "mixtral", "gpt_oss"]
MAX_TOKENS = 8
PROMPTS = random_prompts(0, [1, 5, 17, 40, 97])  # windows of 24: the long ones pass them

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def references(tiny_moe_models):
    return {k: hf_greedy(tiny_moe_models[k], PROMPTS, MAX_TOKENS, True) for k in KINDS}


def _llm(folder, **kw) -> LLM:
    return LLM(str(folder), dtype="float32", **{"num_gpu_blocks_override": 64, **kw})


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_tokens_and_logprobs_match_transformers_under_chunked_prefill(
    tiny_moe_models, references, kind
):
    expected, first = references[kind]
    llm = _llm(tiny_moe_models[kind], max_num_batched_tokens=24, max_num_seqs=8)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    for out, ref in zip(outs, first, strict=True):
        for token, lp in out.outputs[0].logprobs[0].items():
            assert lp == pytest.approx(ref[token].item(), abs=1e-4)


@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
def test_prefix_hits_give_the_same_tokens(tiny_moe_models, references, kind):
    expected, _ = references[kind]
    llm = _llm(tiny_moe_models[kind])
    assert atom_greedy(llm, PROMPTS, MAX_TOKENS) == expected
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    again = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == expected
    # The 97-token prompt's 6 full blocks come from the cache (GPT-OSS: its window layers' last
    # blocks too, or there would be no hit).
    assert again[4].num_cached_tokens == 96 and again[3].num_cached_tokens == 32


@pytest.mark.parametrize(("kind", "blocks"), [("mixtral", 7), ("gpt_oss", 14)])
def test_preemption_under_a_small_kv_pool_matches(tiny_moe_models, kind, blocks):
    prompts = random_prompts(7, [28, 30, 31, 14])
    expected = hf_greedy(tiny_moe_models[kind], prompts, MAX_TOKENS)
    # The four prompts fit (2 + 2 + 2 + 1 blocks of 16; GPT-OSS's window layers as many
    # again) but not their growth: the tail is preempted and recomputed when readmitted.
    llm = _llm(tiny_moe_models[kind], num_gpu_blocks_override=blocks, max_model_len=112)
    assert atom_greedy(llm, prompts, MAX_TOKENS) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.pool.num_free_blocks == blocks


def test_the_sliding_window_shapes_the_answers(tiny_moe_models, references, tmp_path):
    """Without its window GPT-OSS answers the long prompts otherwise: the tests above compare
    windowed attention, not a window that never cuts."""
    expected, _ = references["gpt_oss"]
    folder = make_tiny_model(tmp_path / "gpt_oss_full", "gpt_oss", sliding_window=4096)
    unwindowed = hf_greedy(folder, PROMPTS[3:], MAX_TOKENS)
    assert unwindowed != expected[3:]
    assert ModelConfig.from_file(tiny_moe_models["gpt_oss"]).kv_window == 24
    assert ModelConfig.from_file(tiny_moe_models["mixtral"]).kv_window is None  # all windowed


def test_window_blocks_go_back_once_the_window_has_passed(tiny_moe_models):
    llm = _llm(tiny_moe_models["gpt_oss"])
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    engine.add_request(EngineRequest("long", PROMPTS[4], params))
    held = []
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.running:
            window = [b for b in seq.window_table if b >= 0]
            held.append((seq.num_computed_tokens, len(seq.block_table), len(window)))
    bs = engine.block_size
    # Full-attention blocks grow with the context; the window's stay at the blocks its 24
    # positions (and the block being filled) span, however long the sequence grows.
    assert max(n for _, n, _ in held) == -(-(97 + 59) // bs)
    assert all(w <= 24 // bs + 2 for c, _, w in held if c > 97), held
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_dummy_weights_generate(tiny_moe_models):
    llm = LLM(str(tiny_moe_models["gpt_oss"]), load_format="dummy", max_num_seqs=4)
    assert [len(t) for t in atom_greedy(llm, PROMPTS[:3], MAX_TOKENS)] == [MAX_TOKENS] * 3


_TRITON_RUN = """
import json, sys
from atom_runtime import LLM
from atom_kernels import ops
from tests.hf_reference import atom_greedy
import torch
assert ops.backend_for(torch.zeros(1)) == "triton"
llm = LLM(sys.argv[1], dtype="float32", num_gpu_blocks_override=32, max_num_batched_tokens=40)
print(json.dumps(atom_greedy(llm, json.loads(sys.argv[2]), int(sys.argv[3]))))
"""


@pytest.mark.parametrize("moe_gemv", [False, True])
def test_triton_kernels_in_gpt_oss_match_transformers(tiny_moe_models, references, moe_gemv):
    """The whole engine on the Triton kernels, run by the interpreter on CPU in fp32: the GPU
    code path of GPT-OSS (window and sinks in paged decode and prefill attention, the router,
    fused MoE with biases and the clamped SwiGLU), prompts chunked, the window layers' blocks
    given back. With ATOM_MOE_GEMV=1 one request alone, so its decode steps take the pair
    GEMV."""
    import os
    import subprocess
    import sys

    expected, _ = references["gpt_oss"]
    picked = [3] if moe_gemv else [1, 3]  # 5 + 40 tokens over a 40-token budget: chunked
    env = {**os.environ, "TRITON_INTERPRET": "1", "ATOM_KERNEL_BACKEND": "triton"}
    env["ATOM_MOE_GEMV"] = "1" if moe_gemv else "0"
    run = subprocess.run(
        [sys.executable, "-c", _TRITON_RUN, str(tiny_moe_models["gpt_oss"]),
         json.dumps([PROMPTS[i] for i in picked]), str(MAX_TOKENS)],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == [expected[i] for i in picked]


# -- MXFP4 ---------------------------------------------------------------------------------------


def _random_mxfp4(gen: torch.Generator, rows_shape: tuple[int, ...], cols: int):
    """Random MXFP4 codes and scales (2^-6..2^-4: weights like a trained model's)."""
    blocks = torch.randint(0, 256, (*rows_shape, cols // 32, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(121, 124, (*rows_shape, cols // 32), generator=gen, dtype=torch.uint8)
    return blocks, scales


def test_mxfp4_dequantizes_as_transformers_does():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks, scales = _random_mxfp4(gen, (3, 10), 64)
    ours = dequantize_mxfp4(blocks, scales, torch.float32)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    assert torch.equal(ours, theirs.transpose(1, 2))
    with pytest.raises(ValueError, match="MXFP4 blocks"):
        dequantize_mxfp4(blocks[..., :8], scales, torch.float32)


def test_mxfp4_experts_serve_the_tokens_of_the_dequantized_checkpoint(tiny_moe_models, tmp_path):
    """A GPT-OSS checkpoint as released (experts as MXFP4 blocks and scales, the quantization
    named in config.json) gives the tokens transformers gives on its dequantized weights."""
    src = tiny_moe_models["gpt_oss"]
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    gen = torch.Generator().manual_seed(1)
    packed, plain = dict(tensors), dict(tensors)
    for name in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, k_in, n_out = tensors[name].shape  # transformers' layout: [E, in, out]
        blocks, scales = _random_mxfp4(gen, (e, n_out), k_in)
        del packed[name]
        packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
        plain[name] = dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2).contiguous()
    for folder, weights in ((tmp_path / "mxfp4", packed), (tmp_path / "plain", plain)):
        folder.mkdir()
        for file in src.iterdir():
            if file.name != "model.safetensors":
                shutil.copy(file, folder / file.name)
        save_file(weights, str(folder / "model.safetensors"))
    config = json.loads((tmp_path / "mxfp4" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": []}
    (tmp_path / "mxfp4" / "config.json").write_text(json.dumps(config))
    prompts = PROMPTS[2:4]
    expected = hf_greedy(tmp_path / "plain", prompts, MAX_TOKENS)
    assert atom_greedy(_llm(tmp_path / "mxfp4"), prompts, MAX_TOKENS) == expected
    del packed["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(packed, str(tmp_path / "mxfp4" / "model.safetensors"))
    with pytest.raises(ValueError, match="down_proj_blocks"):
        _llm(tmp_path / "mxfp4")


# -- refusals ----------------------------------------------------------------------------------


def _config(kind: str, **changes) -> dict:
    return {**MOE_CONFIGS[kind], "vocab_size": 128, **changes}


@pytest.mark.parametrize(
    ("kind", "changes", "field"),
    [
        ("qwen3_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ("qwen3_moe", {"moe_intermediate_size": None}, "moe_intermediate_size"),
        ("qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step"),
        ("qwen3_moe", {"mlp_only_layers": [7]}, "mlp_only_layers"),
        ("qwen3_moe", {"hidden_act": "gelu"}, "hidden_act"),
        ("mixtral", {"num_local_experts": None}, "num_local_experts"),
        ("mixtral", {"sliding_window": -4}, "sliding_window"),
        ("gpt_oss", {"layer_types": ["sliding_attention", "chunked_attention"] * 2}, "layer_types"),
        ("gpt_oss", {"layer_types": ["full_attention"]}, "layer_types"),
        ("gpt_oss", {"quantization_config": {"quant_method": "fp8"}}, "quant_method"),
        ("gpt_oss", {"sliding_window": None}, "sliding_window"),
    ],
)
def test_unservable_configs_are_refused_naming_the_field(kind, changes, field):
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf(_config(kind, **changes))


def test_sparse_layers_follow_decoder_sparse_step_and_mlp_only_layers():
    cfg = ModelConfig.from_hf(
        _config("qwen3_moe", num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    )
    assert [cfg.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    assert cfg.qk_norm and not cfg.norm_topk_prob and cfg.num_experts == 8
    released = ModelConfig.from_hf(_config("qwen3_moe", num_experts=128, num_experts_per_tok=8))
    assert released.num_experts == 128  # the released configs' name for it


def test_decode_bound_reads_a_window_per_windowed_layer(tiny_moe_models):
    """`atom bench`'s bound: GPT-OSS's two windowed layers read at most 24 positions each, its
    two full layers the whole context; biases travel with their experts."""
    from atom_runtime.bench.bound import decode_bytes

    llm = _llm(tiny_moe_models["gpt_oss"], num_gpu_blocks_override=16)
    try:
        runner = llm.engine.executor
        db = decode_bytes(runner.model, runner)
    finally:
        llm.shutdown()
    c = MOE_CONFIGS["gpt_oss"]
    per_layer = 2 * c["num_key_value_heads"] * c["head_dim"] * 4
    assert (db.kv_per_token, db.window_kv_per_token, db.window) == (
        2 * per_layer,
        2 * per_layer,
        24,
    )
    h, i = c["hidden_size"], c["intermediate_size"]
    assert db.expert == 4 * (3 * i * h + 2 * i + h) * 4  # gate, up, down and their biases, 4 layers
    assert db.step([100]) - db.step([24]) == 76 * db.kv_per_token  # the window read stays 24

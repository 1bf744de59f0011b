"""DeepSeek-V3 and V2-Lite-like models (multi-head latent attention, grouped top-k MoE) against
transformers, fp32 on CPU, and their latent KV cache.

Pinned: greedy tokens identical to `transformers.generate` (eager attention) and first-step
logprobs close, for prompts of very different lengths; the same under a token budget that cuts
prompts into chunks sharing steps with decodes (both prefill paths run: absorbed short chunks
over a prefix, up-projected long ones), with each prefill path forced alone, on prefix-cache
hits (the chunk attends to cached latents) and under preemption; the cache is one latent row a
token a layer and the memory planner sizes blocks by it; the router equals transformers'; the
multi-token-prediction tensors are skipped with one INFO line; configs the engine cannot serve
are refused naming the field.
"""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import save_file

from atom_runtime import LLM, SamplingParams
from atom_runtime.layers.latent_attention import LatentAttention, upprojection_pays
from atom_runtime.models.config import ModelConfig
from atom_runtime.models.deepseek_moe import grouped_topk
from tests.hf_reference import atom_greedy, hf_greedy, load_reference, random_prompts

KINDS = ["deepseek_v3", "deepseek_v2"]
MAX_TOKENS = 8

pytestmark = pytest.mark.timeout(300)


PROMPTS = random_prompts(0, [1, 5, 17, 40, 97])
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _hf_reference(folder, prompts):
    """transformers' greedy tokens and first-step log-softmax (eager attention), per prompt."""
    return hf_greedy(folder, prompts, MAX_TOKENS, first_logprobs=True, attn_implementation="eager")


@pytest.fixture(scope="module")
def references(tiny_mla_models):
    return {kind: _hf_reference(tiny_mla_models[kind], PROMPTS) for kind in KINDS}


def _greedy(llm: LLM, prompts, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def _attention_layers(llm: LLM) -> list[LatentAttention]:
    return llm.engine.executor.model.attention_layers()


class _PathCounter:
    """Counts the chunks each prefill path attends (wrapping the layers' methods)."""

    def __init__(self, monkeypatch) -> None:
        self.absorbed_rows = 0
        self.upprojected_chunks = 0
        absorbed, upprojected = LatentAttention._absorbed, LatentAttention._upprojected

        def count_absorbed(layer, q, *args):
            self.absorbed_rows += q.shape[0]
            return absorbed(layer, q, *args)

        def count_upprojected(layer, q, kv_b_proj, plan):
            self.upprojected_chunks += len(plan.q_lens)
            return upprojected(layer, q, kv_b_proj, plan)

        monkeypatch.setattr(LatentAttention, "_absorbed", count_absorbed)
        monkeypatch.setattr(LatentAttention, "_upprojected", count_upprojected)


# -- parity ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_tokens_and_logprobs_match_transformers(tiny_mla_models, references, kind):
    expected, first = references[kind]
    llm = LLM(str(tiny_mla_models[kind]), dtype="float32", num_gpu_blocks_override=64)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)
    outs = _greedy(llm, PROMPTS, params)
    assert [o.token_ids for o in outs] == expected
    for out, ref in zip(outs, first, strict=True):
        for token, lp in out.logprobs[0].items():
            assert lp == pytest.approx(ref[token].item(), abs=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_prefill_in_mixed_batches_matches(tiny_mla_models, references, kind, monkeypatch):
    """A 24-token budget cuts the 40- and 97-token prompts into chunks beside other sequences'
    decodes: short chunks over a prefix attend absorbed, long ones up-project their context."""
    counter = _PathCounter(monkeypatch)
    llm = LLM(
        str(tiny_mla_models[kind]), dtype="float32", num_gpu_blocks_override=64,
        max_num_batched_tokens=24, max_num_seqs=8,
    )  # fmt: skip
    assert atom_greedy(llm, PROMPTS, MAX_TOKENS) == references[kind][0]
    assert counter.upprojected_chunks > 0 and counter.absorbed_rows > 0


@pytest.mark.parametrize("path", ["absorbed", "upprojected"])
def test_each_prefill_path_alone_matches(tiny_mla_models, references, path, monkeypatch):
    counter = _PathCounter(monkeypatch)
    llm = LLM(
        str(tiny_mla_models["deepseek_v3"]), dtype="float32", num_gpu_blocks_override=64,
        max_num_batched_tokens=24,
    )  # fmt: skip
    for layer in _attention_layers(llm):
        layer.prefill_path = path
    counter.absorbed_rows = counter.upprojected_chunks = 0  # start-up's warm-up step aside
    assert atom_greedy(llm, PROMPTS, MAX_TOKENS) == references["deepseek_v3"][0]
    if path == "absorbed":
        assert counter.upprojected_chunks == 0
    else:
        assert counter.upprojected_chunks >= 8  # every prompt chunk


def test_prefix_hits_attend_to_cached_latents(tiny_mla_models):
    shared = random_prompts(1, [48])[0]
    prompts = [shared + tail for tail in random_prompts(2, [3, 9, 30])]
    expected, _ = _hf_reference(tiny_mla_models["deepseek_v2"], prompts)
    llm = LLM(str(tiny_mla_models["deepseek_v2"]), dtype="float32", num_gpu_blocks_override=64)
    assert atom_greedy(llm, prompts, MAX_TOKENS) == expected
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == expected
    # 48 shared tokens = 3 full blocks of 16 served from the cache on the second run.
    assert all(o.num_cached_tokens >= 48 for o in again)


def test_preemption_under_a_small_kv_pool_matches(tiny_mla_models):
    folder = tiny_mla_models["deepseek_v3"]
    prompts = random_prompts(7, [28, 30, 31, 14])
    expected, _ = _hf_reference(folder, prompts)
    # 7 blocks of 16 tokens hold the four prompts (2 + 2 + 2 + 1) but not their growth: the
    # tail is preempted and recomputes its latents when readmitted.
    llm = LLM(str(folder), dtype="float32", num_gpu_blocks_override=7, max_model_len=112)
    assert atom_greedy(llm, prompts, MAX_TOKENS) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.pool.num_free_blocks == 7


# -- the latent cache ------------------------------------------------------------------------------


def test_latent_cache_is_one_row_a_token_and_sizes_the_blocks(tiny_mla_models):
    llm = LLM(str(tiny_mla_models["deepseek_v3"]), dtype="float32", num_gpu_blocks_override=20)
    runner = llm.engine.executor
    layers = _attention_layers(llm)
    assert len(layers) == 3
    for layer in layers:
        (cache,) = layer.cache_tensors()
        assert tuple(cache.shape) == (20, 16, 40 + 12)  # kv_lora_rank + qk_rope_head_dim
        assert layer.cache_spec().kind == "mla_latent"
    assert runner.bytes_per_block == 3 * 16 * 52 * 4  # layers x block x latent row x fp32


def test_cpu_budget_holds_latent_blocks(tiny_mla_models, monkeypatch):
    monkeypatch.setenv("ATOM_CPU_KVCACHE_SPACE", "0.001")  # 1 MiB
    llm = LLM(str(tiny_mla_models["deepseek_v3"]), dtype="float32")
    assert llm.engine.executor.num_blocks == (1 << 30) * 0.001 // (3 * 16 * 52 * 4)


def test_upprojection_pays_from_about_171_queries_at_deepseek_v3_dims():
    """Up-projecting costs the context times latent x (nope + v) once; absorbing costs each
    query latent x (2 latent - nope - v) more per key: the break-even query count rises with the
    context towards 512 * 256 / 768 = 170.7."""
    dims = (512, 128, 128)
    for queries, context in ((80, 200), (150, 4096), (170, 100_000)):
        assert not upprojection_pays(queries, context, *dims)
    for queries, context in ((100, 200), (170, 4096), (171, 100_000)):
        assert upprojection_pays(queries, context, *dims)
    assert not upprojection_pays(1, 1000, *dims)  # a decode row
    assert upprojection_pays(8, 8, *dims)  # a fresh prompt, however short


# -- routing, checkpoints, configs -----------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_router_equals_transformers(tiny_mla_models, kind):
    hf = load_reference(tiny_mla_models[kind], attn_implementation="eager")
    hf = hf.model.layers[1].mlp.gate
    cfg = ModelConfig.from_file(tiny_mla_models[kind])
    x = torch.randn(64, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits, want_w, want_ids = hf(x)
    bias = getattr(hf, "e_score_correction_bias", None)
    weights, ids = grouped_topk(
        logits, cfg.num_experts_per_tok, cfg.routing, cfg.norm_topk_prob, bias
    )
    order, want_order = ids.long().argsort(-1), want_ids.argsort(-1)
    assert torch.equal(ids.long().gather(1, order), want_ids.gather(1, want_order))
    torch.testing.assert_close(weights.gather(1, order), want_w.gather(1, want_order))


def test_mtp_layer_is_skipped_with_one_info_line(tiny_mla_models, tmp_path, caplog):
    folder = tmp_path / "with_mtp"
    shutil.copytree(tiny_mla_models["deepseek_v3"], folder)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1 and cfg["num_hidden_layers"] == 3
    mtp = {  # what DeepSeek-V3's checkpoint holds for its MTP module, layer 3 here
        "model.layers.3.eh_proj.weight": torch.zeros(64, 128),
        "model.layers.3.enorm.weight": torch.ones(64),
        "model.layers.3.shared_head.head.weight": torch.zeros(49152, 64),
        "model.layers.3.self_attn.kv_b_proj.weight": torch.zeros(160, 40),
    }
    save_file(mtp, str(folder / "mtp.safetensors"))
    with caplog.at_level(logging.INFO, logger="atom_runtime.models.deepseek"):
        llm = LLM(str(folder), dtype="float32", num_gpu_blocks_override=32)
    notices = [r for r in caplog.records if "multi-token-prediction" in r.getMessage()]
    assert len(notices) == 1 and notices[0].levelno == logging.INFO
    assert "skipped 4 tensors" in notices[0].getMessage()
    assert len(_greedy(llm, PROMPTS[:1])[0].token_ids) == MAX_TOKENS


def test_a_layer_past_the_mtp_layers_is_refused(tiny_mla_models, tmp_path):
    folder = tmp_path / "stray"
    shutil.copytree(tiny_mla_models["deepseek_v3"], folder)
    save_file({"model.layers.4.enorm.weight": torch.ones(64)}, str(folder / "x.safetensors"))
    with pytest.raises(ValueError, match=r"model.layers.4.enorm.weight.*no place"):
        LLM(str(folder), dtype="float32", num_gpu_blocks_override=32)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"scoring_func": "tanh"}, "scoring_func"),
        ({"topk_method": "random"}, "topk_method"),
        ({"n_group": 3}, "n_group"),
        ({"topk_group": 5}, "topk_group"),
        ({"num_experts_per_tok": 7}, "num_experts_per_tok"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"kv_lora_rank": 0}, "kv_lora_rank"),
        ({"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
    ],
)
def test_configs_the_engine_cannot_serve_are_refused_by_field(tiny_mla_models, change, field):
    cfg = json.loads((tiny_mla_models["deepseek_v3"] / "config.json").read_text())
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf(cfg | change)


def test_config_fields_are_read(tiny_mla_models):
    v3 = ModelConfig.from_file(tiny_mla_models["deepseek_v3"])
    assert (v3.mla.q_lora_rank, v3.mla.kv_lora_rank, v3.mla.rope_interleave) == (24, 40, True)
    assert v3.routing.topk_method == "noaux_tc" and v3.routing.scoring_func == "sigmoid"
    assert [v3.is_moe_layer(i) for i in range(3)] == [False, True, True]
    v2 = ModelConfig.from_file(tiny_mla_models["deepseek_v2"])
    assert v2.mla.q_lora_rank is None and v2.routing.scoring_func == "softmax"
    assert v2.routing.n_shared_experts == 2 and not v2.norm_topk_prob
    every_other = ModelConfig.from_hf(
        json.loads((tiny_mla_models["deepseek_v2"] / "config.json").read_text())
        | {"moe_layer_freq": 2, "first_k_dense_replace": 0}
    )
    assert [every_other.is_moe_layer(i) for i in range(3)] == [True, False, True]


def test_each_forward_derives_its_rows_anew_from_reused_metadata(tiny_mla_models):
    """A captured prefill graph replays one metadata object whose tensors are refilled in place:
    the per-token attention rows must be derived inside every forward (none carried over from
    an earlier forward, e.g. the warm-ups before a capture)."""
    from atom_runtime.layers.forward_context import AttentionMetadata, set_attention_metadata

    llm = LLM(str(tiny_mla_models["deepseek_v3"]), dtype="float32", num_gpu_blocks_override=8)
    model = llm.engine.executor.model
    ids = torch.tensor(random_prompts(9, [8])[0])

    def meta(lo: int) -> AttentionMetadata:  # 4 tokens at positions lo..lo+3 in block 2
        return AttentionMetadata(
            slot_mapping=torch.arange(32 + lo, 36 + lo), block_tables=torch.tensor([[2]]),
            seq_lens=torch.tensor([lo + 4], dtype=torch.int32), decode_only=False,
            cu_seqlens_q=torch.tensor([0, 4], dtype=torch.int32), max_seqlen_q=4,
        )  # fmt: skip

    def forward(m: AttentionMetadata, lo: int) -> torch.Tensor:
        set_attention_metadata(m)
        try:
            with torch.inference_mode():
                return model(ids[lo : lo + 4], torch.arange(lo, lo + 4))
        finally:
            set_attention_metadata(None)

    reused = meta(0)
    forward(reused, 0)
    fresh = forward(meta(4), 4)  # the second chunk with metadata of its own
    for name, t in vars(meta(4)).items():  # refill the first step's tensors in place
        if isinstance(t, torch.Tensor):
            getattr(reused, name).copy_(t)
    torch.testing.assert_close(forward(reused, 4), fresh)

"""Small random Hugging Face models on disk, the reference for the engine's outputs.

Each is written with `transformers` (config.json + safetensors) next to the default model's
tokenizer (rebuilt from the SmolLM2 GGUF and saved as tokenizer.json), so the same folder serves
the engine, the server and transformers itself.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import torch

VOCAB = 49152  # the SmolLM2 tokenizer's vocabulary

CONFIGS = {
    "llama": dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
    "llama3": dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        tie_word_embeddings=True,
    ),
    "qwen2": dict(
        model_type="qwen2",
        architectures=["Qwen2ForCausalLM"],
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
    ),
    "qwen3": dict(
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
    ),
}

# Sparse-MoE models: their own fixture. Odd head counts, several experts, and (Mixtral, GPT-OSS)
# a sliding window shorter than the longer test prompts.
MOE_CONFIGS = {
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        architectures=["Qwen3MoeForCausalLM"],
        hidden_size=64,
        intermediate_size=96,  # the dense layer's
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=3,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        mlp_only_layers=[1],  # one dense layer among the MoE ones
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
    ),
    "mixtral": dict(
        model_type="mixtral",
        architectures=["MixtralForCausalLM"],
        hidden_size=64,
        intermediate_size=48,
        num_local_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=5,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=24,
        rms_norm_eps=1e-5,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
    ),
    "gpt_oss": dict(
        model_type="gpt_oss",
        architectures=["GptOssForCausalLM"],
        hidden_size=64,
        intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=4,  # sliding, full, sliding, full
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=24,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
}

_HYBRID_COMMON = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    full_attention_interval=2,  # linear, full, linear
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    tie_word_embeddings=False,
)
_MOE = dict(
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
)
# Hybrid (Gated DeltaNet + gated attention) models: their own fixture, as they cost more to build.
HYBRID_CONFIGS = {
    "qwen3_5": dict(
        model_type="qwen3_5_text", architectures=["Qwen3_5ForCausalLM"], **_HYBRID_COMMON
    ),
    "qwen3_5_moe": dict(
        model_type="qwen3_5_moe_text",
        architectures=["Qwen3_5MoeForCausalLM"],
        **_HYBRID_COMMON,
        **_MOE,
    ),
    "qwen3_next": dict(
        model_type="qwen3_next",
        architectures=["Qwen3NextForCausalLM"],
        **_HYBRID_COMMON,
        # The shared expert as wide as a routed one, as in the released models: the engine
        # stacks it after them (qwen3_5_moe keeps _MOE's wider one beside the experts).
        **(_MOE | {"shared_expert_intermediate_size": _MOE["moe_intermediate_size"]}),
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[1],  # one dense layer among the MoE ones
    ),
}


_MLA_COMMON = dict(
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    first_k_dense_replace=1,  # one dense layer, then MoE layers
    kv_lora_rank=40,
    qk_nope_head_dim=20,
    qk_rope_head_dim=12,
    v_head_dim=12,
    n_routed_experts=8,
    num_experts_per_tok=3,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
# DeepSeek (multi-head latent attention, grouped top-k MoE): awkward widths (latent 40, rope 12,
# heads 5 and 3), YaRN with an attention factor and a softmax-scale correction.
MLA_CONFIGS = {
    "deepseek_v3": dict(
        model_type="deepseek_v3",
        architectures=["DeepseekV3ForCausalLM"],
        **_MLA_COMMON,
        num_attention_heads=5,
        num_key_value_heads=5,
        q_lora_rank=24,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 256,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    ),  # fmt: skip
    # V2-Lite's shape: no q_lora, softmax scores, two shared experts, no renormalization.
    "deepseek_v2": dict(
        model_type="deepseek_v2",
        architectures=["DeepseekV2ForCausalLM"],
        **(_MLA_COMMON | {"hidden_size": 72}),  # transformers' V2 wants heads | hidden_size
        num_attention_heads=3,
        num_key_value_heads=3,
        q_lora_rank=None,
        topk_method="group_limited_greedy",
        n_group=2,
        topk_group=1,
        n_shared_experts=2,
        routed_scaling_factor=1.5,
        norm_topk_prob=False,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 256,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    ),  # fmt: skip
}


_HYBRID_MODELING = [
    "transformers.models.qwen3_5.modeling_qwen3_5",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
    "transformers.models.qwen3_next.modeling_qwen3_next",
]


def hybrid_references_on_torch() -> None:
    """Make transformers' hybrid models use their pure-torch Gated DeltaNet, the reference.

    transformers binds fla-core's Triton kernels at import time when fla is importable, and
    those cannot run the CPU reference (a GPU box with `atom-serving[fla]` installed). Import (or
    re-import) the modeling modules with fla hidden, once a process; the engine's own fla lookup
    is untouched."""
    global _references_on_torch
    if _references_on_torch:
        return
    saved = {k: m for k, m in sys.modules.items() if k == "fla" or k.startswith("fla.")}
    for name in saved:
        del sys.modules[name]
    sys.modules["fla"] = None  # import fla -> ImportError while the modules bind their kernels
    try:
        for name in _HYBRID_MODELING:
            module = sys.modules.get(name)
            if module is None:
                importlib.import_module(name)
            else:
                importlib.reload(module)
    finally:
        del sys.modules["fla"]
        sys.modules.update(saved)
    _references_on_torch = True


_references_on_torch = False


def make_tiny_model(
    folder: Path, kind: str, seed: int = 0, mtp_layers: int = 0, **overrides
) -> Path:
    """Write a random `kind` model (see CONFIGS, MOE_CONFIGS, HYBRID_CONFIGS,
    MLA_CONFIGS; `overrides`
    replace config fields) to folder; returns the folder. `mtp_layers` (hybrid and MLA kinds): a
    multi-token-prediction head of that many layers too, as the released checkpoints carry it
    (`mtp.*`, or DeepSeek's `model.layers.{num_hidden_layers + k}.*`, tensors in their own file,
    declared in config.json; transformers ignores both)."""
    import transformers

    from atom_runtime.models.loader import default_model_path
    from atom_runtime.text.tokenizer import Tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    hybrid = kind in HYBRID_CONFIGS
    if hybrid:
        hybrid_references_on_torch()
    base = HYBRID_CONFIGS.get(kind) or MLA_CONFIGS.get(kind) or MOE_CONFIGS.get(kind)
    spec = dict(base or CONFIGS[kind], **overrides)
    spread_norms = hybrid or kind in MLA_CONFIGS
    spec.update(vocab_size=VOCAB, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2)
    spec.update(overrides)
    model_type = spec.pop("model_type")
    spec.pop("architectures")
    if mtp_layers:
        nextn = kind == "qwen3_next" or kind in MLA_CONFIGS
        spec["num_nextn_predict_layers" if nextn else "mtp_num_hidden_layers"] = mtp_layers
    config = transformers.AutoConfig.for_model(model_type, **spec)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    # Wider weights than the default init so greedy tokens are decided by clear margins.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.08)
            elif spread_norms:  # (1 + w) norms start at 0, others at 1: all get a spread
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zeros by default: make it count
                b.normal_(0, 0.05)
    model.save_pretrained(folder, safe_serialization=True)
    if mtp_layers and kind in MLA_CONFIGS:
        _write_deepseek_mtp_layers(folder, model, config, mtp_layers)
    elif mtp_layers:
        _write_mtp_head(folder, model, config, mtp_layers)
    try:
        tok = Tokenizer.from_gguf(default_model_path())
    except FileNotFoundError:
        return folder  # no default model here (e.g. a bare GPU box): token-id prompts only
    tok.hf.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": tok.bos_token,
                "eos_token": tok.eos_token,
                "add_bos_token": False,
                "chat_template": tok.chat_template,
            }
        )
    )
    return folder


def _mtp_rand(t: torch.Tensor, norm: bool, gen: torch.Generator) -> torch.Tensor:
    scale = 0.1 if norm else 0.08
    return (torch.randn(t.shape, generator=gen) * scale).contiguous()


def _write_deepseek_mtp_layers(folder: Path, model, config, num_layers: int) -> None:
    """Random DeepSeek-V3 MTP layers `model.layers.{num_hidden_layers + k}`: `enorm`, `hnorm`,
    `eh_proj`, `shared_head.norm`, the last decoder layer's tensors (a MoE layer's), and the
    copies of the embedding and LM head the released checkpoints carry."""
    from safetensors.torch import save_file

    state = model.state_dict()
    last, h = config.num_hidden_layers - 1, config.hidden_size
    gen = torch.Generator().manual_seed(1234)
    out = {}
    for layer in range(config.num_hidden_layers, config.num_hidden_layers + num_layers):
        p = f"model.layers.{layer}."
        out[p + "eh_proj.weight"] = _mtp_rand(torch.empty(h, 2 * h), False, gen)
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            out[f"{p}{norm}.weight"] = 1 + _mtp_rand(torch.empty(h), True, gen)
        for name, t in state.items():
            if name.startswith(f"model.layers.{last}."):
                rest = name[len(f"model.layers.{last}.") :]
                out[p + rest] = (1 + _mtp_rand(t, True, gen)) if "norm" in rest else (
                    _mtp_rand(t, False, gen))  # fmt: skip
        out[p + "embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
        out[p + "shared_head.head.weight"] = state["lm_head.weight"].clone()
    save_file(out, str(folder / "mtp.safetensors"))


def _write_mtp_head(folder: Path, model, config, num_layers: int) -> None:
    """Random `mtp.*` tensors shaped as a Qwen3.5 / Qwen3-Next MTP head: `fc`, its two input
    norms and the final one, and per layer the tensors of one of the model's full-attention
    layers (its MLP a MoE layer's when the model has experts)."""
    from safetensors.torch import save_file

    state = model.state_dict()
    types = config.layer_types
    full = types.index("full_attention")
    moe = next(
        (i for i in range(len(types)) if any(f"layers.{i}.mlp.experts" in n for n in state)),
        full,
    )
    gen = torch.Generator().manual_seed(1234)

    def rand(t: torch.Tensor, norm: bool) -> torch.Tensor:
        scale = 0.1 if norm else 0.08
        return (torch.randn(t.shape, generator=gen) * scale).contiguous()

    h = config.hidden_size
    out = {"mtp.fc.weight": rand(torch.empty(h, 2 * h), False)}
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        out[f"mtp.{norm}.weight"] = rand(torch.empty(h), True)
    for layer in range(num_layers):
        for name, t in state.items():
            for source, keep in ((full, ".mlp." not in name), (moe, ".mlp." in name)):
                prefix = f"model.layers.{source}."
                if name.startswith(prefix) and keep:
                    out[f"mtp.layers.{layer}.{name[len(prefix) :]}"] = rand(t, "norm" in name)
    save_file(out, str(folder / "mtp.safetensors"))

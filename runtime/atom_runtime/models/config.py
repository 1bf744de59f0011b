"""ModelConfig: the architecture facts the engine needs, read from a Hugging Face config.json
(or built from GGUF metadata), with the differences between Llama-family variants made explicit."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from atom_runtime.models.mla_config import GroupedTopkRouting, LatentAttentionConfig

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# Hybrid models: Gated DeltaNet layers (per-request recurrent state) between gated full-attention
# layers. The multimodal Qwen3.5 configs nest the language model under `text_config`.
HYBRID_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
LAYER_TYPES = ("linear_attention", "full_attention")
# Multi-head latent attention with a latent KV cache and grouped top-k MoE (models/deepseek.py).
MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str = "bfloat16"
    # -- hybrid models (Qwen3.5, Qwen3.5-MoE, Qwen3-Next); None/defaults for the Llama family --
    layer_types: list[str] | None = None  # per layer: "linear_attention" or "full_attention"
    partial_rotary_factor: float = 1.0  # rotary on the first head_dim * factor channels
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    # Qwen3-Next stores q/k/v/z (and b/a) interleaved per key-head group in one projection;
    # Qwen3.5 stores them as separate projections ("split").
    gdn_projection_layout: str = "split"
    num_experts: int = 0  # 0: dense MLP in every layer
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    # -- DeepSeek-V2/V3 (models/mla_config.py); None for every other family --
    mla: LatentAttentionConfig | None = None  # multi-head latent attention
    routing: GroupedTopkRouting | None = None  # grouped top-k routing, shared experts
    # Multi-token-prediction layers the checkpoint carries (DeepSeek-V3 and Qwen3-Next's
    # num_nextn_predict_layers, Qwen3.5's mtp_num_hidden_layers): speculative decoding's `mtp`.
    num_nextn_predict_layers: int = 0

    @property
    def is_hybrid(self) -> bool:
        return self.layer_types is not None

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, i: int) -> bool:
        if self.routing is not None:
            return self.num_experts > 0 and self.routing.is_moe_layer(i)
        return (
            self.num_experts > 0
            and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelConfig:
        model_type = cfg.get("model_type", "")
        if model_type in HYBRID_MODEL_TYPES:
            return _hybrid_from_hf(cls, cfg)
        if model_type in MLA_MODEL_TYPES:
            from atom_runtime.models.mla_config import deepseek_from_hf

            return deepseek_from_hf(cfg)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES + HYBRID_MODEL_TYPES + MLA_MODEL_TYPES)}"
            )
        heads = cfg["num_attention_heads"]
        # transformers >= 5 keeps rope settings in `rope_parameters`; older configs at top level.
        rope = dict(cfg.get("rope_parameters") or {})
        theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling") or (
            rope if rope.get("rope_type") not in (None, "default") else None
        )
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        return cls.from_hf(json.loads(path.read_text()))


def _hybrid_from_hf(cls, top: dict) -> ModelConfig:
    """A Qwen3.5 / Qwen3.5-MoE / Qwen3-Next config.json, refused with the offending field named
    when the engine cannot serve it."""
    model_type = top["model_type"]
    cfg = dict(top.get("text_config") or top) if model_type in ("qwen3_5", "qwen3_5_moe") else top

    def need(name: str):
        if cfg.get(name) is None:
            raise ValueError(f"{name}: missing from the {model_type} config")
        return cfg[name]

    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act: {act!r} is not supported for {model_type} (silu only)")
    num_layers = need("num_hidden_layers")
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        interval = cfg.get("full_attention_interval", 4)
        if not isinstance(interval, int) or interval < 1:
            raise ValueError(
                f"full_attention_interval: must be a positive integer, got {interval!r}"
            )
        layer_types = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(num_layers)
        ]
    layer_types = list(layer_types)
    if len(layer_types) != num_layers:
        raise ValueError(
            f"layer_types: {len(layer_types)} entries for num_hidden_layers={num_layers}"
        )
    bad = sorted({t for t in layer_types if t not in LAYER_TYPES})
    if bad:
        raise ValueError(
            f"layer_types: {bad} not supported (this engine serves {', '.join(LAYER_TYPES)})"
        )
    if "full_attention" not in layer_types:
        raise ValueError("layer_types: at least one full_attention layer is needed (the KV cache)")
    rope = dict(cfg.get("rope_parameters") or {})
    factor = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    heads = need("num_attention_heads")
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    if not 0 < factor <= 1 or int(head_dim * factor) % 2:
        raise ValueError(
            f"partial_rotary_factor: {factor} of head_dim {head_dim} must give an even rotary dim"
        )
    if cfg.get("attn_output_gate", True) is False:
        raise ValueError("attn_output_gate: false is not supported (Qwen3.5/Next gate attention)")
    nk, nv = need("linear_num_key_heads"), need("linear_num_value_heads")
    if nv % nk:
        raise ValueError(
            f"linear_num_value_heads: {nv} is not a multiple of linear_num_key_heads ({nk})"
        )
    if need("linear_conv_kernel_dim") < 2:
        raise ValueError("linear_conv_kernel_dim: must be at least 2")
    moe = model_type in ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
    num_experts = cfg.get("num_experts", 0) if moe else 0
    if num_experts:
        top_k = need("num_experts_per_tok")
        if not 1 <= top_k <= num_experts:
            raise ValueError(
                f"num_experts_per_tok: {top_k} must be in [1, num_experts={num_experts}]"
            )
    sparse_step = cfg.get("decoder_sparse_step", 1) or 1
    base = {k: v for k, v in cfg.items() if k not in ("model_type", "rope_scaling")}
    base["model_type"] = "qwen3"  # the Llama-family fields parse the same way
    base.setdefault("intermediate_size", cfg.get("moe_intermediate_size", 0))
    base.setdefault("max_position_embeddings", 32768)
    if rope.get("rope_type") in (None, "default", "mrope"):
        # Text-only positions: M-RoPE's three position streams coincide, i.e. plain rotary.
        rope = {"rope_theta": rope.get("rope_theta", cfg.get("rope_theta", 10000.0))}
    base["rope_parameters"] = rope
    parsed = ModelConfig.from_hf(base)
    parsed.model_type = model_type
    parsed.qk_norm = True
    parsed.attention_bias = bool(cfg.get("attention_bias", False))
    parsed.head_dim = head_dim
    parsed.tie_word_embeddings = bool(
        cfg.get("tie_word_embeddings", top.get("tie_word_embeddings", False))
    )
    parsed.eos_token_ids = (
        parsed.eos_token_ids
        or ModelConfig.from_hf({**base, "eos_token_id": top.get("eos_token_id")}).eos_token_ids
    )
    parsed.torch_dtype = str(top.get("torch_dtype") or top.get("dtype") or parsed.torch_dtype)
    parsed.layer_types = layer_types
    parsed.partial_rotary_factor = float(factor)
    parsed.linear_num_key_heads = nk
    parsed.linear_num_value_heads = nv
    parsed.linear_key_head_dim = need("linear_key_head_dim")
    parsed.linear_value_head_dim = need("linear_value_head_dim")
    parsed.linear_conv_kernel_dim = cfg["linear_conv_kernel_dim"]
    parsed.gdn_projection_layout = "interleaved" if model_type == "qwen3_next" else "split"
    parsed.num_nextn_predict_layers = _num_mtp_layers(cfg)
    parsed.num_experts = num_experts
    if num_experts:
        parsed.num_experts_per_tok = cfg["num_experts_per_tok"]
        parsed.moe_intermediate_size = need("moe_intermediate_size")
        parsed.shared_expert_intermediate_size = cfg.get("shared_expert_intermediate_size") or 0
        # Qwen3.5-MoE always renormalises the top-k weights; Qwen3-Next says so in its config.
        parsed.norm_topk_prob = bool(cfg.get("norm_topk_prob", True))
        parsed.decoder_sparse_step = sparse_step
        parsed.mlp_only_layers = list(cfg.get("mlp_only_layers") or [])
    return parsed


def _num_mtp_layers(cfg: dict) -> int:
    """MTP layers a config declares, under either name in use."""
    for name in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
        value = cfg.get(name)
        if value is not None:
            if type(value) is not int or value < 0:
                raise ValueError(f"{name}: must be a non-negative integer, got {value!r}")
            return value
    return 0

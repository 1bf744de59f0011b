"""ModelConfig: the architecture facts the engine needs, read from a Hugging Face config.json
(or built from GGUF metadata), with the differences between Llama-family variants made explicit."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from atom_runtime.layers.moe import MoESpec
    from atom_runtime.models.mla_config import GroupedTopkRouting, LatentAttentionConfig

# Llama-family decoders; Qwen3-MoE and Mixtral are the same with sparse MoE layers.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral")
# GPT-OSS: alternating sliding-window and full attention with sinks, MoE with biases.
GPT_OSS_MODEL_TYPES = ("gpt_oss",)
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
    output_bias: bool = False  # o_proj carries a bias (GPT-OSS)
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
    num_nextn_predict_layers: int = 0  # MTP layers stored after the decoder layers
    # -- GPT-OSS-style experts: router and expert biases, clamped SwiGLU (layers.moe.MoESpec) --
    router_bias: bool = False
    expert_bias: bool = False
    expert_activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # How the checkpoint stores the experts: None (plain tensors) or "mxfp4" (GPT-OSS,
    # dequantized at load).
    expert_quantization: str | None = None
    # -- sliding-window attention (Mistral, Mixtral, GPT-OSS) --
    sliding_window: int | None = None  # keys within this many positions, the query's included
    sliding_layers: list[int] = field(default_factory=list)  # the layers that use the window
    attention_sinks: bool = False  # a learned per-head logit in every softmax's denominator
    # The checkpoint's `quantization_config`, as written (models/quant_config.py reads it).
    quantization_config: dict | None = None

    @property
    def is_hybrid(self) -> bool:
        return self.layer_types is not None

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def kv_window(self) -> int | None:
        """The window of the sliding-window layers when they keep their KV blocks apart from the
        full-attention layers' (both kinds present: GPT-OSS), so blocks a window has passed go
        back to the pool (docs/kv-groups.md); None: one block table for every layer."""
        if self.sliding_window is None or not self.sliding_layers:
            return None
        return self.sliding_window if len(self.sliding_layers) < self.num_hidden_layers else None

    def is_sliding_layer(self, i: int) -> bool:
        return self.sliding_window is not None and i in self.sliding_layers

    def moe_spec(self) -> MoESpec:
        from atom_runtime.layers.moe import MoESpec

        return MoESpec(
            hidden_size=self.hidden_size,
            num_experts=self.num_experts,
            top_k=self.num_experts_per_tok,
            intermediate_size=self.moe_intermediate_size,
            renormalize=self.norm_topk_prob,
            shared_intermediate_size=self.shared_expert_intermediate_size,
            router_bias=self.router_bias,
            expert_bias=self.expert_bias,
            activation=self.expert_activation,
            swiglu_alpha=self.swiglu_alpha,
            swiglu_limit=self.swiglu_limit,
        )

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
        if model_type in GPT_OSS_MODEL_TYPES:
            return _gpt_oss_from_hf(cfg)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES + GPT_OSS_MODEL_TYPES + HYBRID_MODEL_TYPES + MLA_MODEL_TYPES)}"
            )
        parsed = _llama_from_hf(cls, cfg)
        if model_type in ("qwen3_moe", "mixtral"):
            _add_moe(parsed, cfg)
        if model_type in ("mistral", "mixtral") and cfg.get("sliding_window"):
            _add_window(parsed, cfg["sliding_window"], range(parsed.num_hidden_layers))
        return parsed

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        return cls.from_hf(json.loads(path.read_text()))


def local_hybrid_model_type(model: str | None) -> str | None:
    """The model_type of a hybrid model given as a local folder or config.json; None otherwise
    (not hybrid, the default model, a GGUF file (Llama family only), a hub id, unreadable)."""
    if model is None:
        return None
    path = Path(model).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.suffix != ".json" or not path.is_file():
        return None
    try:
        config = ModelConfig.from_file(path)
    except (OSError, ValueError, KeyError, TypeError):
        return None  # the refusal stands without the hybrid reason; loading would fail anyway
    return config.model_type if config.is_hybrid else None


def _llama_from_hf(cls, cfg: dict) -> ModelConfig:
    """The fields every Llama-family config.json shares."""
    model_type = cfg.get("model_type", "")
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
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
        quantization_config=cfg.get("quantization_config"),
    )


def _hybrid_from_hf(cls, top: dict) -> ModelConfig:
    """A Qwen3.5 / Qwen3.5-MoE / Qwen3-Next config.json, refused with the offending field named
    when the engine cannot serve it."""
    model_type = top["model_type"]
    cfg = dict(top.get("text_config") or top) if model_type in ("qwen3_5", "qwen3_5_moe") else top
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act: {act!r} is not supported for {model_type} (silu only)")
    layer_types = _hybrid_layer_types(cfg, model_type)
    rope = dict(cfg.get("rope_parameters") or {})
    factor = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    heads = _need(cfg, "num_attention_heads", model_type)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    _check_hybrid_mixers(cfg, model_type, head_dim, factor)
    moe = model_type in ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
    num_experts = cfg.get("num_experts", 0) if moe else 0
    if num_experts:
        top_k = _need(cfg, "num_experts_per_tok", model_type)
        if not 1 <= top_k <= num_experts:
            raise ValueError(
                f"num_experts_per_tok: {top_k} must be in [1, num_experts={num_experts}]"
            )
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
    parsed.quantization_config = top.get("quantization_config") or cfg.get("quantization_config")
    parsed.layer_types = layer_types
    parsed.partial_rotary_factor = float(factor)
    _set_hybrid_mixer_fields(parsed, cfg)
    parsed.num_experts = num_experts
    if num_experts:
        _set_hybrid_moe_fields(parsed, cfg)
    return parsed


def _hybrid_layer_types(cfg: dict, model_type: str) -> list[str]:
    """Each layer's kind, from `layer_types` or every `full_attention_interval`-th layer full
    attention; refused unless the engine serves every kind and one layer holds a KV cache."""
    num_layers = _need(cfg, "num_hidden_layers", model_type)
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
    return layer_types


def _check_hybrid_mixers(cfg: dict, model_type: str, head_dim: int, factor: float) -> None:
    """Refuse a gated attention or Gated DeltaNet layout the kernels cannot run."""
    if not 0 < factor <= 1 or int(head_dim * factor) % 2:
        raise ValueError(
            f"partial_rotary_factor: {factor} of head_dim {head_dim} must give an even rotary dim"
        )
    if cfg.get("attn_output_gate", True) is False:
        raise ValueError("attn_output_gate: false is not supported (Qwen3.5/Next gate attention)")
    nk = _need(cfg, "linear_num_key_heads", model_type)
    nv = _need(cfg, "linear_num_value_heads", model_type)
    if nv % nk:
        raise ValueError(
            f"linear_num_value_heads: {nv} is not a multiple of linear_num_key_heads ({nk})"
        )
    if _need(cfg, "linear_conv_kernel_dim", model_type) < 2:
        raise ValueError("linear_conv_kernel_dim: must be at least 2")


def _set_hybrid_mixer_fields(parsed: ModelConfig, cfg: dict) -> None:
    """The Gated DeltaNet layers' shapes and the multi-token-prediction layers."""
    model_type = parsed.model_type
    parsed.linear_num_key_heads = cfg["linear_num_key_heads"]
    parsed.linear_num_value_heads = cfg["linear_num_value_heads"]
    parsed.linear_key_head_dim = _need(cfg, "linear_key_head_dim", model_type)
    parsed.linear_value_head_dim = _need(cfg, "linear_value_head_dim", model_type)
    parsed.linear_conv_kernel_dim = cfg["linear_conv_kernel_dim"]
    parsed.gdn_projection_layout = "interleaved" if model_type == "qwen3_next" else "split"
    parsed.num_nextn_predict_layers = _num_mtp_layers(cfg)


def _set_hybrid_moe_fields(parsed: ModelConfig, cfg: dict) -> None:
    """A hybrid MoE's experts: top-k, widths, the shared expert and which layers are sparse."""
    parsed.num_experts_per_tok = cfg["num_experts_per_tok"]
    parsed.moe_intermediate_size = _need(cfg, "moe_intermediate_size", parsed.model_type)
    parsed.shared_expert_intermediate_size = cfg.get("shared_expert_intermediate_size") or 0
    # Qwen3.5-MoE always renormalises the top-k weights; Qwen3-Next says so in its config.
    parsed.norm_topk_prob = bool(cfg.get("norm_topk_prob", True))
    parsed.decoder_sparse_step = cfg.get("decoder_sparse_step", 1) or 1
    parsed.mlp_only_layers = list(cfg.get("mlp_only_layers") or [])


def _need(cfg: dict, name: str, model_type: str):
    if cfg.get(name) is None:
        raise ValueError(f"{name}: missing from the {model_type} config")
    return cfg[name]


def _add_moe(parsed: ModelConfig, cfg: dict) -> None:
    """Qwen3-MoE's and Mixtral's sparse layers: which layers, how many experts, how wide."""
    model_type = parsed.model_type
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act: {act!r} is not supported for {model_type} (silu only)")
    if model_type == "mixtral":
        experts = _need(cfg, "num_local_experts", model_type)
        parsed.moe_intermediate_size = parsed.intermediate_size
        parsed.norm_topk_prob = True  # Mixtral always renormalises its top-k weights
    else:
        # Released configs say num_experts; transformers 5 saves it as num_local_experts.
        experts = cfg.get("num_experts", cfg.get("num_local_experts"))
        if experts is None:
            raise ValueError(f"num_experts: missing from the {model_type} config")
        parsed.moe_intermediate_size = _need(cfg, "moe_intermediate_size", model_type)
        parsed.norm_topk_prob = bool(cfg.get("norm_topk_prob", False))
        step = cfg.get("decoder_sparse_step", 1)
        if not isinstance(step, int) or step < 1:
            raise ValueError(f"decoder_sparse_step: must be a positive integer, got {step!r}")
        parsed.decoder_sparse_step = step
        only = list(cfg.get("mlp_only_layers") or [])
        bad = [i for i in only if not isinstance(i, int) or not 0 <= i < parsed.num_hidden_layers]
        if bad:
            raise ValueError(f"mlp_only_layers: {bad} are not layer indices")
        parsed.mlp_only_layers = only
    top_k = _need(cfg, "num_experts_per_tok", model_type)
    if not isinstance(experts, int) or experts < 1 or not 1 <= top_k <= experts:
        raise ValueError(
            f"num_experts_per_tok: {top_k} must be in [1, experts={experts}] for {model_type}"
        )
    parsed.num_experts, parsed.num_experts_per_tok = experts, top_k


def _add_window(parsed: ModelConfig, window, layers) -> None:
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window: must be a positive integer, got {window!r}")
    parsed.sliding_window = window
    parsed.sliding_layers = list(layers)


GPT_OSS_LAYER_TYPES = ("sliding_attention", "full_attention")


def _gpt_oss_from_hf(cfg: dict) -> ModelConfig:
    """GPT-OSS: a Llama-shaped trunk (biased q/k/v/o, YaRN rope), sliding_attention and
    full_attention layers (alternating in the releases), attention sinks, and MoE layers whose
    router and experts carry biases and whose SwiGLU is clamped; its experts may be MXFP4."""
    t = "gpt_oss"
    num_layers = _need(cfg, "num_hidden_layers", t)
    layer_types = cfg.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)
    ]
    if len(layer_types) != num_layers:
        raise ValueError(
            f"layer_types: {len(layer_types)} entries for num_hidden_layers={num_layers}"
        )
    bad = sorted({x for x in layer_types if x not in GPT_OSS_LAYER_TYPES})
    if bad:
        raise ValueError(f"layer_types: {bad} not supported for gpt_oss ({GPT_OSS_LAYER_TYPES})")
    quant = cfg.get("quantization_config") or {}
    method = quant.get("quant_method")
    if method not in (None, "mxfp4"):
        raise ValueError(f"quantization_config.quant_method: {method!r} is not supported (mxfp4)")
    experts = cfg.get("num_local_experts", cfg.get("num_experts"))
    base = {k: v for k, v in cfg.items() if k not in ("model_type", "layer_types")}
    base.update(model_type="llama", num_local_experts=experts)
    base.setdefault("max_position_embeddings", 131072)
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope.setdefault("rope_theta", cfg.get("rope_theta", 150000.0))
    base["rope_parameters"], base["rope_scaling"] = rope, None
    parsed = _llama_from_hf(ModelConfig, base)
    parsed.model_type = t
    parsed.attention_bias = parsed.output_bias = bool(cfg.get("attention_bias", True))
    parsed.attention_sinks = True
    parsed.intermediate_size = parsed.moe_intermediate_size = _need(cfg, "intermediate_size", t)
    top_k = cfg.get("num_experts_per_tok", cfg.get("experts_per_token"))
    if not isinstance(experts, int) or not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise ValueError(
            f"num_experts_per_tok: {top_k} must be in [1, num_local_experts={experts}]"
        )
    parsed.num_experts, parsed.num_experts_per_tok = experts, top_k
    parsed.norm_topk_prob = True  # softmax over the top-k logits: the same weights
    parsed.router_bias = parsed.expert_bias = True
    parsed.expert_activation = "swiglu_clamped"
    parsed.swiglu_alpha = float(cfg.get("swiglu_alpha", 1.702))
    parsed.swiglu_limit = float(cfg.get("swiglu_limit", 7.0))
    parsed.expert_quantization = method
    sliding = [i for i, x in enumerate(layer_types) if x == "sliding_attention"]
    if sliding:
        _add_window(parsed, cfg.get("sliding_window"), sliding)
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

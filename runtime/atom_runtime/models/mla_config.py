"""DeepSeek-V2/V3 config.json fields: multi-head latent attention and grouped top-k routing.

`deepseek_from_hf` reads a `deepseek_v2` / `deepseek_v3` config into a `ModelConfig` whose
`mla` and `routing` say what the Llama-family fields cannot, and refuses what the engine cannot
serve, naming the field. Defaults are transformers' for each model type (so a config written
by `save_pretrained` and one from the hub read the same).
"""

from __future__ import annotations

from dataclasses import dataclass

from atom_runtime.models.config import ModelConfig

SCORING_FUNCS = ("softmax", "sigmoid")
# greedy: top-k over all experts; group_limited_greedy: groups ranked by their best expert;
# noaux_tc: scores + e_score_correction_bias, groups ranked by their two best (DeepSeek-V3).
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True)
class LatentAttentionConfig:
    q_lora_rank: int | None  # None: q_proj straight from the hidden state (V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # rotary over interleaved pairs (DeepSeek) rather than halves

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class GroupedTopkRouting:
    scoring_func: str
    topk_method: str
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    n_shared_experts: int
    first_k_dense_replace: int
    moe_layer_freq: int

    @property
    def correction_bias(self) -> bool:
        """Whether the router carries `e_score_correction_bias` (aux-loss-free balancing)."""
        return self.topk_method == "noaux_tc"

    @property
    def grouped(self) -> bool:
        return self.topk_method != "greedy" and self.n_group > 1

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0


def _positive(cfg: dict, name: str, model_type: str) -> int:
    value = cfg.get(name)
    if not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{name}: must be a positive integer in the {model_type} config, got {value!r}"
        )
    return value


def deepseek_from_hf(cfg: dict) -> ModelConfig:
    model_type = cfg["model_type"]
    v3 = model_type == "deepseek_v3"
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act: {act!r} is not supported for {model_type} (silu only)")
    if cfg.get("mlp_bias"):
        raise ValueError(f"mlp_bias: true is not supported for {model_type}")
    q_lora = cfg.get("q_lora_rank")
    mla = LatentAttentionConfig(
        q_lora_rank=None if q_lora is None else _positive(cfg, "q_lora_rank", model_type),
        kv_lora_rank=_positive(cfg, "kv_lora_rank", model_type),
        qk_nope_head_dim=_positive(cfg, "qk_nope_head_dim", model_type),
        qk_rope_head_dim=_positive(cfg, "qk_rope_head_dim", model_type),
        v_head_dim=_positive(cfg, "v_head_dim", model_type),
        # transformers' DeepSeek-V2 always rotates interleaved pairs (complex numbers).
        rope_interleave=bool(cfg.get("rope_interleave", True)) if v3 else True,
    )
    if mla.qk_rope_head_dim % 2:
        raise ValueError(f"qk_rope_head_dim: {mla.qk_rope_head_dim} must be even")
    heads = _positive(cfg, "num_attention_heads", model_type)
    base = dict(cfg)
    base.update(model_type="llama", head_dim=mla.qk_head_dim, num_key_value_heads=heads)
    parsed = ModelConfig.from_hf(base)
    parsed.model_type = model_type
    parsed.mla = mla
    parsed.num_nextn_predict_layers = int(cfg.get("num_nextn_predict_layers") or 0)
    experts = cfg.get("n_routed_experts") or 0
    if experts:
        parsed.num_experts = experts
        parsed.num_experts_per_tok = _positive(cfg, "num_experts_per_tok", model_type)
        parsed.moe_intermediate_size = _positive(cfg, "moe_intermediate_size", model_type)
        parsed.norm_topk_prob = bool(cfg.get("norm_topk_prob", v3))
        parsed.routing = _routing(cfg, model_type, experts, parsed.num_experts_per_tok)
    return parsed


def _routing(cfg: dict, model_type: str, experts: int, top_k: int) -> GroupedTopkRouting:
    v3 = model_type == "deepseek_v3"
    scoring = cfg.get("scoring_func") or ("sigmoid" if v3 else "softmax")
    if scoring not in SCORING_FUNCS:
        raise ValueError(f"scoring_func: {scoring!r} is not supported ({', '.join(SCORING_FUNCS)})")
    method = cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    if method not in TOPK_METHODS:
        raise ValueError(f"topk_method: {method!r} is not supported ({', '.join(TOPK_METHODS)})")
    routing = GroupedTopkRouting(
        scoring_func=scoring,
        topk_method=method,
        n_group=cfg.get("n_group") or 1,
        topk_group=cfg.get("topk_group") or cfg.get("n_group") or 1,
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 2.5 if v3 else 1.0)),
        n_shared_experts=int(cfg.get("n_shared_experts", 1 if v3 else 2) or 0),
        first_k_dense_replace=int(cfg.get("first_k_dense_replace", 3 if v3 else 0) or 0),
        moe_layer_freq=int(cfg.get("moe_layer_freq") or 1),
    )
    if not 1 <= top_k <= experts:
        raise ValueError(f"num_experts_per_tok: {top_k} must be in [1, n_routed_experts={experts}]")
    if routing.topk_method != "greedy":
        g, tg = routing.n_group, routing.topk_group
        if experts % g:
            raise ValueError(f"n_group: {g} does not divide n_routed_experts={experts}")
        if not 1 <= tg <= g:
            raise ValueError(f"topk_group: {tg} must be in [1, n_group={g}]")
        if top_k > tg * (experts // g):
            raise ValueError(
                f"num_experts_per_tok: {top_k} is more than the {tg} chosen groups hold"
            )
        if routing.correction_bias and g > 1 and experts // g < 2:
            raise ValueError(f"n_group: {g} leaves fewer than two experts a group for noaux_tc")
    return routing

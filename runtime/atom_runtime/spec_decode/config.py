"""`--speculative-config`: vLLM's SpeculativeConfig field names, checked at startup.

{"method": "ngram" | "draft_model" | "mtp", "num_speculative_tokens": k,
 "model": "<draft model folder>" (draft_model only),
 "prompt_lookup_min": n, "prompt_lookup_max": m (ngram only),
 "draft_tensor_parallel_size": 1 (the drafting model runs whole on rank 0 under tensor
 parallelism)}

A field this runtime does not know is refused by name (vLLM has more of them, e.g.
`disable_by_batch_size`; silently ignoring one would change what the user asked for). Whether a
method fits the model (an MTP head in the checkpoint, a draft with the target's vocabulary) is
checked once the model config is known (`check_fits_model`, `check_draft_fits`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

FIELD = "speculative_config"
METHODS = ("ngram", "draft_model", "mtp")
# vLLM's model-specific MTP method names: the same thing here (the model says which head).
MTP_ALIASES = ("deepseek_mtp", "qwen3_next_mtp", "qwen3_5_mtp", "mimo_mtp", "glm4_moe_mtp")
# vLLM methods without a proposer here: refused by name.
NOT_YET = ("eagle", "eagle3", "medusa", "mlp_speculator", "suffix")
KNOWN_FIELDS = (
    "method",
    "num_speculative_tokens",
    "model",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "draft_tensor_parallel_size",
)
# vLLM's n-gram window when neither bound is given.
DEFAULT_LOOKUP = 5
# Draft tokens a step may carry per sequence. Past a few the expected gain flattens ((1 - a^(k+1))
# / (1 - a) tends to 1 / (1 - a)) while the verify step keeps growing; 16 is a sanity bound.
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int = DEFAULT_LOOKUP
    prompt_lookup_max: int = DEFAULT_LOOKUP
    draft_tensor_parallel_size: int = 1

    @property
    def uses_model(self) -> bool:
        """Whether drafting runs a model (its own KV, written past the verified tokens)."""
        return self.method in ("draft_model", "mtp")

    @property
    def lookahead(self) -> int:
        """Cache slots a step reserves past its verified tokens for the drafter's own KV: the
        drafting model writes its k - 1 further inputs after the step's last accepted token."""
        return self.num_speculative_tokens if self.uses_model else 0

    @classmethod
    def from_cli(cls, text: str | dict | None) -> SpeculativeConfig | None:
        """Parse and check the flag's JSON (or the dict `LLM(speculative_config=...)` takes);
        ValueError naming the field on anything wrong."""
        if text is None:
            return None
        if isinstance(text, dict):
            raw = dict(text)
        else:
            try:
                raw = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"{FIELD}: not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{FIELD}: must be a JSON object")
        unknown = sorted(set(raw) - set(KNOWN_FIELDS))
        if unknown:
            raise ValueError(
                f"{FIELD}.{unknown[0]}: not a field this runtime knows (it knows "
                f"{', '.join(KNOWN_FIELDS)})"
            )
        method = _method(raw)
        k = raw.get("num_speculative_tokens")
        if type(k) is not int or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"{FIELD}.num_speculative_tokens: required, an integer in "
                f"1..{MAX_SPECULATIVE_TOKENS}, got {k!r}"
            )
        model = raw.get("model")
        if method == "draft_model" and (not isinstance(model, str) or not model):
            raise ValueError(f"{FIELD}.model: draft_model needs the draft model's path")
        if method != "draft_model" and model is not None:
            raise ValueError(f"{FIELD}.model: only draft_model takes a model ({method} has none)")
        low, high = _lookup(raw, method)
        draft_tp = raw.get("draft_tensor_parallel_size")
        if draft_tp is not None and (type(draft_tp) is not int or draft_tp != 1):
            raise ValueError(
                f"{FIELD}.draft_tensor_parallel_size: only 1 is supported (the drafter runs whole "
                f"on rank 0's GPU beside the target), got {draft_tp!r}"
            )
        return cls(method, k, model, low, high, 1)

    def check_fits_model(self, model_type: str, num_mtp_layers: int) -> None:
        """Refuse a method the target model cannot serve, naming it."""
        if self.method == "mtp" and num_mtp_layers < 1:
            raise ValueError(
                f"{FIELD}.method: mtp needs a model whose checkpoint carries MTP layers; "
                f"{model_type} declares none (mtp_num_hidden_layers / num_nextn_predict_layers)"
            )

    def check_configs(self, target: Any, draft: Any = None) -> None:
        """Every check that needs only the model configs (`ModelConfig`s of the target and, for
        draft_model, the draft): run before any weight is read (models/preflight.py)."""
        self.check_fits_model(target.model_type, target.num_nextn_predict_layers)
        if self.method == "draft_model":
            if draft is None:
                raise ValueError(f"{FIELD}.model: draft_model needs the draft model's config")
            check_draft_fits(target.vocab_size, draft.vocab_size, draft.model_type, draft.is_hybrid)

    def as_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in KNOWN_FIELDS}


def _method(raw: dict) -> str:
    method = raw.get("method")
    if method is None:
        # vLLM infers a draft model from `model` alone.
        if raw.get("model"):
            return "draft_model"
        raise ValueError(f"{FIELD}.method: required, one of {', '.join(METHODS)}")
    if method in MTP_ALIASES:
        return "mtp"
    if method in NOT_YET:
        raise ValueError(
            f"{FIELD}.method: {method} is not available in this runtime; use one of "
            f"{', '.join(METHODS)}"
        )
    if method not in METHODS:
        raise ValueError(f"{FIELD}.method: unknown method {method!r}; known: {', '.join(METHODS)}")
    return method


def _lookup(raw: dict, method: str) -> tuple[int, int]:
    """The n-gram window [prompt_lookup_min, prompt_lookup_max]: vLLM's defaults (both 5; one
    given sets the other)."""
    low, high = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
    if method != "ngram":
        if low is not None or high is not None:
            name = "prompt_lookup_min" if low is not None else "prompt_lookup_max"
            raise ValueError(f"{FIELD}.{name}: only the ngram method takes it")
        return DEFAULT_LOOKUP, DEFAULT_LOOKUP
    for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
        if value is not None and (type(value) is not int or value < 1):
            raise ValueError(f"{FIELD}.{name}: must be an integer >= 1, got {value!r}")
    low = low if low is not None else (high if high is not None else DEFAULT_LOOKUP)
    high = high if high is not None else low
    if low > high:
        raise ValueError(
            f"{FIELD}.prompt_lookup_min: {low} is larger than prompt_lookup_max ({high})"
        )
    return low, high


def check_draft_fits(target_vocab: int, draft_vocab: int, draft_model_type: str, hybrid: bool):
    """Refuse a draft model that cannot propose for this target, naming why."""
    if hybrid:
        raise ValueError(
            f"{FIELD}.model: {draft_model_type} is a hybrid model; a draft keeps only a KV "
            "cache here (its recurrent state would need slots of its own): use a dense draft"
        )
    if draft_vocab != target_vocab:
        raise ValueError(
            f"{FIELD}.model: the draft's vocabulary ({draft_vocab} tokens) differs from the "
            f"target's ({target_vocab}); a draft must share the target's tokenizer"
        )

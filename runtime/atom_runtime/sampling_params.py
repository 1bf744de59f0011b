"""SamplingParams: how one request samples, with vLLM's field names and validation.

A msgspec Struct so it crosses the API-server/engine-core socket as msgpack, never pickle. Every
invalid value raises ValueError naming the field; the server turns that into a 400 with `param`.
"""

from __future__ import annotations

import json

import msgspec

_GREEDY_EPS = 1e-5
MAX_N = 128  # completions per request (OpenAI's bound): each is an engine request of its own
_INT64_MAX = 2**63 - 1  # integers travel as msgpack int64 to the engine core


STRUCTURED_FIELD = "structured_outputs"
# The largest constraint a request may ask for, in bytes of its source (a schema, regex or
# grammar; a choice list counts each string plus CHOICE_OVERHEAD_BYTES). Compiling grows with it
# (about a second for 8,000 short choices on one core); the engine compiles off its own thread,
# and this bounds how long one request holds that worker.
MAX_CONSTRAINT_BYTES = 128 << 10
CHOICE_OVERHEAD_BYTES = 16


class StructuredOutputs(
    msgspec.Struct, omit_defaults=True, kw_only=True, forbid_unknown_fields=True
):
    json: str | None = None  # a JSON schema, serialized
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark syntax (llguidance's dialect)
    json_object: bool = False  # any JSON object
    # JSON only: no whitespace between tokens ({"a":1,"b":2}). Off by default, as in vLLM: a
    # model writes its JSON as trained; small models can ramble in whitespace, this stops it.
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name)]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(
                f"{STRUCTURED_FIELD}: exactly one of json, regex, choice, grammar, json_object must be set"
                f", got {given or 'none'}"
            )
        if self.choice is not None and not all(isinstance(c, str) and c for c in self.choice):
            raise ValueError(f"{STRUCTURED_FIELD}: choice must be a list of non-empty strings")
        size = self.source_bytes()
        if size > MAX_CONSTRAINT_BYTES:
            raise ValueError(
                f"{STRUCTURED_FIELD}: the constraint is {size} bytes, more than the "
                f"{MAX_CONSTRAINT_BYTES} one request may ask for"
            )
        if self.json is not None:
            try:
                json.loads(self.json)
            except ValueError as e:
                raise ValueError(
                    f"{STRUCTURED_FIELD}: json is not a valid JSON schema ({e})"
                ) from None

    def source_bytes(self) -> int:
        """How big the constraint is (what MAX_CONSTRAINT_BYTES bounds)."""
        if self.choice is not None:
            return sum(
                len(c.encode("utf-8", "surrogatepass")) + CHOICE_OVERHEAD_BYTES for c in self.choice
            )
        text = self.json or self.regex or self.grammar or ""
        return len(text.encode("utf-8", "surrogatepass"))

    def grammar_text(self) -> str:
        """The llguidance grammar for this request (not yet checked against a tokenizer)."""
        from llguidance import LLMatcher

        options = {"whitespace_flexible": not self.disable_any_whitespace}
        if self.json is not None:
            return LLMatcher.grammar_from_json_schema(self.json, overrides=options)
        if self.json_object:
            return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=options)
        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            # Lark string literals take JSON's escapes.
            return LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in self.choice)
            )
        return LLMatcher.grammar_from_lark(self.grammar)


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k filtering
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs per output token (0: the sampled token's only)
    prompt_logprobs: int | None = None  # the same per prompt token (the first has none)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, [-100, 100]
    allowed_token_ids: list[int] | None = None  # sample only among these
    structured_outputs: StructuredOutputs | None = None  # a JSON schema, regex, choice, grammar
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._check_sampling()
        self._check_lengths_and_stops()
        self._check_logprobs_penalties_and_masks()

    def _check_sampling(self) -> None:
        _check(
            _int_in(self.n, 1, MAX_N), "n", f"must be an integer in [1, {MAX_N}], got {self.n!r}"
        )
        _check(
            _is_number(self.temperature) and self.temperature >= 0,
            "temperature",
            f"must be a number >= 0, got {self.temperature!r}",
        )
        _check(
            _is_number(self.top_p) and 0 < self.top_p <= 1,
            "top_p",
            f"must be in (0, 1], got {self.top_p!r}",
        )
        _check(
            _int_in(self.top_k, -1, _INT64_MAX),
            "top_k",
            f"must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}",
        )
        _check(
            _is_number(self.min_p) and 0 <= self.min_p <= 1,
            "min_p",
            f"must be in [0, 1], got {self.min_p!r}",
        )

    def _check_lengths_and_stops(self) -> None:
        _check(
            self.seed is None or _int_in(self.seed, -_INT64_MAX - 1, _INT64_MAX),
            "seed",
            f"must be a 64-bit integer, got {self.seed!r}",
        )
        _check(
            self.max_tokens is None or _int_in(self.max_tokens, 1, _INT64_MAX),
            "max_tokens",
            f"must be an integer >= 1, got {self.max_tokens!r}",
        )
        _check(
            _int_in(self.min_tokens, 0, _INT64_MAX),
            "min_tokens",
            f"must be an integer >= 0, got {self.min_tokens!r}",
        )
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
            )
        if self.stop is not None:
            _check(
                isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
                "stop",
                "must be a non-empty string or a list of non-empty strings",
            )
        if self.stop_token_ids is not None:
            _check(
                isinstance(self.stop_token_ids, list)
                and all(_int_in(t, 0, _INT64_MAX) for t in self.stop_token_ids),
                "stop_token_ids",
                "must be a list of non-negative integers",
            )

    def _check_logprobs_penalties_and_masks(self) -> None:
        _check(
            self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
            "logprobs",
            f"must be an integer in [0, 20], got {self.logprobs!r}",
        )
        _check(
            self.prompt_logprobs is None or _int_in(self.prompt_logprobs, 0, 20),
            "prompt_logprobs",
            f"must be an integer in [0, 20], got {self.prompt_logprobs!r}",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(
                _is_number(value) and -2 <= value <= 2, name, f"must be in [-2, 2], got {value!r}"
            )
        _check(
            _is_number(self.repetition_penalty) and 0 < self.repetition_penalty <= 2,
            "repetition_penalty",
            f"must be in (0, 2], got {self.repetition_penalty!r}",
        )
        if self.logit_bias is not None:
            _check(
                isinstance(self.logit_bias, dict)
                and all(_int_in(t, 0, _INT64_MAX) for t in self.logit_bias),
                "logit_bias",
                "must map non-negative integer token ids to numbers",
            )
            bad = next(
                (b for b in self.logit_bias.values() if not (_is_number(b) and -100 <= b <= 100)),
                None,
            )
            _check(bad is None, "logit_bias", f"biases must be in [-100, 100], got {bad!r}")
        if self.allowed_token_ids is not None:
            _check(
                isinstance(self.allowed_token_ids, list)
                and len(self.allowed_token_ids) > 0
                and all(_int_in(t, 0, _INT64_MAX) for t in self.allowed_token_ids),
                "allowed_token_ids",
                "must be a non-empty list of non-negative integers",
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1.0
        )

    @property
    def edits_logits(self) -> bool:
        """A logit bias or an allowed-token set changes this request's logits before sampling."""
        return (
            bool(self.logit_bias)
            or self.allowed_token_ids is not None
            or self.structured_outputs is not None
        )

    def token_ids_named(self) -> dict[str, list[int]]:
        """Every token id the request names, by field (the engine checks them against the
        vocabulary)."""
        named = {
            "stop_token_ids": self.stop_token_ids or [],
            "logit_bias": list(self.logit_bias or ()),
            "allowed_token_ids": self.allowed_token_ids or [],
        }
        return {field: ids for field, ids in named.items() if ids}

    def clone(self, **changes) -> SamplingParams:
        return msgspec.structs.replace(self, **changes)


def _int_in(value: object, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field}: {message}")

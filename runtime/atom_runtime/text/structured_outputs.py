"""Structured outputs: a request's text held to a JSON schema, a regex, a choice of strings or a
Lark grammar, by masking every token the grammar cannot take next.

`StructuredOutputs` is what a request asks for (vLLM's `StructuredOutputsParams` fields: exactly
one of `json`, `regex`, `choice`, `grammar`, `json_object`). `Guides` turns it into a matcher per
sequence with llguidance (its JSON-schema, regex and Lark compilers; token masks computed in
Rust), built against the model's own tokenizer. Each step the model runner asks every guided
sequence's matcher for its bitmask of allowed tokens and the sampler masks the rest; the engine
feeds each sampled token back to the matcher, and finishes the sequence when the grammar is
complete. A guided sequence's next step waits for its previous token (like the penalties, it
needs its history): with async scheduling it sits out the steps prepared while its token is in
flight (the scheduler skips it), and the rest of the batch keeps overlapping.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

FIELD = "structured_outputs"


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
                f"{FIELD}: exactly one of json, regex, choice, grammar, json_object must be set"
                f", got {given or 'none'}"
            )
        if self.choice is not None and not all(isinstance(c, str) and c for c in self.choice):
            raise ValueError(f"{FIELD}: choice must be a list of non-empty strings")
        if self.json is not None:
            try:
                json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"{FIELD}: json is not a valid JSON schema ({e})") from None

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


class Guides:
    """Matchers for guided sequences, against the model's tokenizer (loaded on first use: a
    server that never sees a guided request never pays for it)."""

    def __init__(self, model_path: str, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.model_path = model_path
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._tokenizer = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            try:
                from llguidance import LLTokenizer

                from atom_runtime.text.tokenizer import Tokenizer

                tok = Tokenizer.from_path(Path(self.model_path), self.eos_token_ids)
                self._tokenizer = LLTokenizer(
                    tok.hf.to_str(), n_vocab=self.vocab_size, eos_token=tok.eos_token_ids
                )
            except Exception as e:  # refuse the request, keep the engine
                raise ValueError(
                    f"{FIELD}: unavailable for this model ({type(e).__name__}: {e})"
                ) from None
        return self._tokenizer

    def matcher(self, spec: StructuredOutputs):
        """A fresh matcher for one sequence. Raises ValueError naming the field when the schema,
        regex or grammar does not compile."""
        tokenizer = self.tokenizer
        from llguidance import LLMatcher

        try:
            grammar = spec.grammar_text()
        except ValueError as e:
            raise ValueError(f"{FIELD}: {e}") from None
        error = LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise ValueError(f"{FIELD}: {error.strip()}")
        return LLMatcher(tokenizer, grammar, log_level=0)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def fill_bitmasks(matchers: list, vocab_size: int):
    """[len(matchers), words] int32 numpy array: bit t of each row set when the grammar allows
    token t."""
    import numpy as np  # (not at the top: `atom operator` imports this package without numpy)

    words = bitmask_words(vocab_size)
    out = np.zeros((len(matchers), words), dtype=np.int32)
    for row, matcher in enumerate(matchers):
        mask = np.frombuffer(matcher.compute_bitmask(), dtype=np.int32)[:words]
        out[row, : len(mask)] = mask
    return out

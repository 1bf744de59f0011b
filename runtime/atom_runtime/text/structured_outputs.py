"""Structured outputs: a request's text held to a JSON schema, a regex, a choice of strings or a
Lark grammar, by masking every token the grammar cannot take next.

`StructuredOutputs` (sampling_params.py) is what a request asks for (vLLM's
`StructuredOutputsParams` fields: exactly one of `json`, `regex`, `choice`, `grammar`,
`json_object`). `Guides` turns it into a matcher per
sequence with llguidance (its JSON-schema, regex and Lark compilers; token masks computed in
Rust), built against the model's own tokenizer. Each step the model runner asks every guided
sequence's matcher for its bitmask of allowed tokens and the sampler masks the rest; the engine
feeds each sampled token back to the matcher, and finishes the sequence when the grammar is
complete. A guided sequence's next step waits for its previous token (like the penalties, it
needs its history): with async scheduling it sits out the steps prepared while its token is in
flight (the scheduler skips it), and the rest of the batch keeps overlapping.
"""

from __future__ import annotations

import threading
from pathlib import Path

from atom_runtime.sampling_params import STRUCTURED_FIELD as FIELD
from atom_runtime.sampling_params import StructuredOutputs


class Guides:
    """Matchers for guided sequences, against the model's tokenizer: built on first use (a
    process that never sees a guided request never pays for it), or in the background from
    `start_building` (the engine-core process, while its model loads: the build holds the GIL for
    a second or more, which at the first guided request would stall every stream)."""

    def __init__(self, model_path: str, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.model_path = model_path
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._tokenizer = None
        self._error: str | None = None  # why it cannot be built (kept: never retried)
        self._builder: threading.Thread | None = None

    def start_building(self) -> None:
        self._builder = threading.Thread(target=self._build, name="atom-guides", daemon=True)
        self._builder.start()

    def wait(self) -> None:
        """Until a build started by `start_building` is over."""
        if self._builder is not None:
            self._builder.join()
            self._builder = None

    @property
    def tokenizer(self):
        self.wait()
        if self._tokenizer is None and self._error is None:
            self._build()
        if self._error is not None:  # refuse the request, keep the engine
            raise ValueError(f"{FIELD}: unavailable for this model ({self._error})")
        return self._tokenizer

    def _build(self) -> None:
        try:
            from llguidance import LLTokenizer

            from atom_runtime.text.tokenizer import Tokenizer

            tok = Tokenizer.from_path(Path(self.model_path), self.eos_token_ids)
            self._tokenizer = LLTokenizer(
                tok.hf.to_str(), n_vocab=self.vocab_size, eos_token=tok.eos_token_ids
            )
        except Exception as e:
            self._error = f"{type(e).__name__}: {e}"

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

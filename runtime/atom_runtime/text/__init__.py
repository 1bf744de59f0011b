"""Text in and out of token ids: the tokenizer and chat template, incremental detokenization, and
structured outputs (grammars that mask the tokens a request may take next)."""

"""Speculative decoding: a step mode of the engine (propose -> verify -> accept).

Drafts come from n-gram lookup over a sequence's own tokens (`ngram.py`), a smaller draft model
with its own KV cache (`draft_model.py`) or the target's MTP layers (`mtp.py`); the model runner
verifies k drafts a sequence in one forward of k + 1 rows and keeps the longest prefix the
rejection sampler accepts (`rejection.py`), which leaves greedy output unchanged and sampled
output distributed as the target's. docs/speculative-decoding.md.
"""

"""Model building blocks: tensor-parallel linear layers, attention over the paged KV cache,
norms, rotary embedding, vocab-parallel embedding and LM head, and the sampler."""

"""The engine's bookkeeping, no tensors: requests (`Sequence`), the KV block pool and each
sequence's view of it, and the scheduler that batches them under a token budget."""

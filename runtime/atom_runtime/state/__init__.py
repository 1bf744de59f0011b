"""Per-request state of hybrid (recurrent) models: the slot pool, and later its checkpoints."""

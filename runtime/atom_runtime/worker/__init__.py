"""Where the model runs: the executor (one rank, or tensor-parallel ranks), the model runner that
turns a scheduled batch into tensors and samples, CUDA graphs and the batch-1 kernel choice."""

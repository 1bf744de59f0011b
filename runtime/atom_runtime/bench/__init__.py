"""`atom bench`: the workloads of docs/benchmarks.md (W1-W5) with an optional peer measured in the
same run."""

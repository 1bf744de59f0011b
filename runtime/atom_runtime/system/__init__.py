"""The machine and process the engine runs on: device and dtype, the tensor-parallel process
group, process titles and the GC policy."""

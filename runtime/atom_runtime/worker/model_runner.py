"""ModelRunner: turns a scheduled batch into tensors, runs the model, samples.

It owns the model and the KV cache tensors, and drives three helpers of its own: the decode CUDA
graphs (cuda_graphs.py), the sampler with its per-request generators (layers/sampler.py) and the
batch-1 kernel choice made at start-up (small_m.py). It makes no policy decisions (the scheduler
does). CPU is a first-class device; on a GPU the same runner sizes the cache from
`gpu_memory_utilization` after a profiling forward.

One step is three parts: `prepare_inputs` (batch -> host arrays, `StepInputs`), `forward` (the
model and the LM head; under tensor parallelism every rank runs it on the same StepInputs) and
`sample` (only where the scheduler lives: rank 0).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import numpy as np
import torch

from atom_kernels import varlen_attention
from atom_runtime.config import MAX_NUM_BATCHED_TOKENS, EngineConfig
from atom_runtime.core.batch import ScheduledBatch
from atom_runtime.core.sequence import PENDING_TOKEN, Sequence
from atom_runtime.layers.forward_context import (
    AttentionMetadata,
    StateMetadata,
    fresh_chunk_lengths,
    padding_state_metadata,
    set_attention_metadata,
    set_state_metadata,
)
from atom_runtime.models.config import ModelConfig
from atom_runtime.models.loader import build_model
from atom_runtime.protocol.worker import StepInputs
from atom_runtime.state.checkpoint_spec import (
    PagedStateCheckpointSpec,
    StatePoolPlan,
    StateTensorShape,
)
from atom_runtime.state.copy_plan import StateCopyPlan
from atom_runtime.state.maintenance import uint8_rows
from atom_runtime.state.slot_pool import StateTensors, plan_state_slots
from atom_runtime.system.device import resolve_device, resolve_dtype, to_device, to_device_many
from atom_runtime.system.distributed import all_reduce_min, tp_rank, tp_size
from atom_runtime.worker.cuda_graphs import (
    DecodeGraphs,
    PrefillGraphs,
    default_capture_sizes,
    default_prefill_buckets,
)
from atom_runtime.worker.kernel_choice import select_small_m_kernels
from atom_runtime.worker.sampler import Sampler, SamplerOutput

log = logging.getLogger(__name__)

CPU_KVCACHE_ENV = "ATOM_CPU_KVCACHE_SPACE"  # GiB of host memory for the KV cache on CPU
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
DENSE_PREFILL_ENV = "ATOM_DENSE_PREFILL"


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, model_path: Path) -> None:
        self.config = config
        self.model_config = model_config
        self.device = resolve_device(config.device)
        if self.device.type == "cuda" and tp_size() > 1:
            self.device = torch.device("cuda", tp_rank())  # one GPU per rank
            torch.cuda.set_device(self.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.block_size = config.block_size
        torch.manual_seed(config.seed)
        self.model = build_model(
            model_path, model_config, config.load_format, self.dtype, self.device, config.seed
        )
        attn = self.model.attention_layers()
        self.num_heads = attn[0].num_heads
        self.num_kv_heads = attn[0].num_kv_heads
        self.head_dim = attn[0].head_dim
        self.num_layers = len(attn)
        self.dense_prefill = self._enable_dense_prefill(attn)
        # Hybrid models: per-request recurrent state in slots, sized next to the KV cache.
        state_layers = self.model.state_layers() if hasattr(self.model, "state_layers") else []
        self.state = StateTensors(state_layers, self.dtype, self.device) if state_layers else None
        self.num_state_slots = 0
        self._planned_slots = 0
        # Every rank must hold the same block ids: the cache is as large as the smallest allows.
        self.num_blocks = all_reduce_min(self._decide_num_blocks(), self.device)
        self._allocate_kv_cache()
        self.checkpoint_spec: PagedStateCheckpointSpec | None = None
        self._copy_plan: StateCopyPlan | None = None
        if self.state is not None:
            self._allocate_state_slots()
            self._plan_checkpoint_copies()
        self.small_m_kernels = select_small_m_kernels(
            self.model, self.device, self.num_blocks, self.block_size
        )
        self.sampler = Sampler(self.device, model_config.vocab_size)
        # The last prepared step's prompt_logprobs work: (sequence, first position, index of its
        # first logits row, rows), and where the sampling rows sit among the logits rows (None:
        # every logits row samples).
        self._prompt_jobs: list[tuple[Sequence, int, int, int]] = []
        self._sampler_pos: list[int] | None = None
        # The last step's samplers and sampled ids, on the device: the next step's inputs may
        # take tokens from them before they are read back (async scheduling).
        self._last_samplers: list[Sequence] = []
        self._last_token_ids: torch.Tensor | None = None
        self.graphs = DecodeGraphs()
        self.prefill_graphs = PrefillGraphs()
        # Banned until min_tokens is reached; the engine sets them once the model is known.
        self.eos_token_ids: list[int] = []

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
        asked = os.environ.get(DENSE_PREFILL_ENV, "")
        wide = first.num_heads * first.head_dim >= varlen_attention.WIDE_QUERY
        on = (
            (asked == "1" or (asked != "0" and wide))
            and self.device.type == "cuda"
            and varlen_attention.supported(
                self.device, self.dtype, first.num_heads, first.num_kv_heads, first.head_dim
            )
        )
        for layer in layers:
            layer.dense_prefill = on
        if not on:
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

    # -- KV cache --------------------------------------------------------------------------------

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    @property
    def state_bytes_per_slot(self) -> int:
        return 0 if self.state is None else self.state.bytes_per_slot

    def _decide_num_blocks(self) -> int:
        override = self.config.num_gpu_blocks_override
        if self.state is not None:
            return self._plan_hybrid_memory(override)
        if override is not None:
            return override
        if self.device.type == "cuda":
            return self._profile_gpu_blocks()
        space = float(os.environ.get(CPU_KVCACHE_ENV, "2")) * (1 << 30)
        return max(1, int(space // self.bytes_per_block))

    def _plan_hybrid_memory(self, override: int | None) -> int:
        """Split the cache budget (GPU: what is left after weights and the peak activation;
        CPU: ATOM_CPU_KVCACHE_SPACE) between state slots and KV blocks (`plan_state_slots`)."""
        if self.device.type == "cuda":
            budget = self._profile_gpu_budget()
        else:
            budget = float(os.environ.get(CPU_KVCACHE_ENV, "2")) * (1 << 30)
        plan = plan_state_slots(
            budget,
            self.state.bytes_per_slot,
            self.bytes_per_block,
            self.config.max_num_seqs,
            fixed_blocks=override,
        )
        if plan.num_blocks < 1:
            raise RuntimeError(
                f"no room for the KV cache next to {plan.num_slots} state slots: raise "
                "--gpu-memory-utilization or lower --max-num-seqs"
            )
        self._planned_slots = plan.num_slots
        return plan.num_blocks

    def _allocate_state_slots(self) -> None:
        """Allocate the slots every rank agreed on; cap max_num_seqs to them (a running sequence
        holds one slot)."""
        self.num_state_slots = all_reduce_min(self._planned_slots, self.device)
        self.state.allocate(self.num_state_slots)
        if self.config.max_num_seqs > self.num_state_slots:
            log.warning(
                "max_num_seqs capped from %d to %d: the state slots that fit in memory",
                self.config.max_num_seqs,
                self.num_state_slots,
            )
            self.config.max_num_seqs = self.num_state_slots
        log.info(
            "hybrid state: %d slots of %.2f MiB each (%d stateful layers), %.2f GiB in all",
            self.num_state_slots,
            self.state.bytes_per_slot / 2**20,
            len(self.state.layers),
            self.num_state_slots * self.state.bytes_per_slot / 2**30,
        )

    def _plan_checkpoint_copies(self) -> None:
        """The checkpoint spec of this rank's shard (PAGE unit: one block's K/V rows in every
        attention layer; image: a slot's row in every state tensor, in slot-pool order) and the
        byte views the per-batch copy launch works on."""
        attn = self.model.attention_layers()
        shapes = []
        for i, layer in enumerate(self.state.layers):
            for name, shape, dtype in zip(
                ("conv", "recurrent"), layer.state_shapes(), self.state.dtypes(), strict=True
            ):
                shapes.append(StateTensorShape(f"layer{i}.{name}", tuple(shape), dtype))
        plan = StatePoolPlan(
            self.block_size, len(attn), self.num_kv_heads, self.head_dim, self.dtype, tuple(shapes)
        )
        spec = PagedStateCheckpointSpec.from_plan(plan)
        if spec.image_bytes != self.state.bytes_per_slot:
            raise RuntimeError(
                f"state checkpoint image ({spec.image_bytes} bytes) differs from the slot "
                f"({self.state.bytes_per_slot} bytes)"
            )
        pool_segments = [uint8_rows(t) for layer in attn for t in (layer.k_cache, layer.v_cache)]
        slot_segments = [
            uint8_rows(t)
            for layer in self.state.layers
            for t in (layer.conv_state, layer.ssm_state)
        ]
        self.checkpoint_spec = spec
        self._copy_plan = StateCopyPlan(pool_segments, slot_segments, spec)

    def copy_state(self, unit_rows: np.ndarray) -> None:
        """Run a batch's checkpoint copies (a `UnitCopyTable`'s rows): one `ops.state_copy_`
        launch on the current stream, so it completes before the forward that follows it."""
        if self._copy_plan is None:
            raise RuntimeError("state copies for a model without state checkpoints")
        self._copy_plan.run(torch.from_numpy(np.asarray(unit_rows, dtype=np.int64)))

    def _profile_gpu_blocks(self) -> int:
        budget = self._profile_gpu_budget()
        num_blocks = int(budget // self.bytes_per_block)
        if num_blocks < 1:
            raise RuntimeError(
                f"no room for the KV cache in {budget / 2**30:.2f} GiB: raise "
                "--gpu-memory-utilization or lower --max-num-batched-tokens"
            )
        return num_blocks

    def _profile_gpu_budget(self) -> float:
        """Run the largest batch once against a one-block cache (and one state slot), then
        return what is left under gpu_memory_utilization after weights and that peak."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        tokens = self.max_num_batched_tokens
        self.num_blocks = 1
        self._allocate_kv_cache()
        if self.state is not None:
            self.state.allocate(1)
        blocks_wide = -(-tokens // self.block_size)
        meta = AttentionMetadata(
            slot_mapping=torch.full((tokens,), -1, dtype=torch.int64, device=self.device),
            block_tables=torch.zeros((1, blocks_wide), dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([tokens], dtype=torch.int32, device=self.device),
            decode_only=False,
            cu_seqlens_q=torch.tensor([0, tokens], dtype=torch.int32, device=self.device),
            max_seqlen_q=tokens,
            # The path a whole-budget prompt takes: on the dense path, padded to its bucket.
            fresh_chunks=(tokens,),
            dense_rows=self._dense_rows((tokens,)),
        )
        ids = torch.zeros(tokens, dtype=torch.int64, device=self.device)
        pos = torch.arange(tokens, dtype=torch.int64, device=self.device)
        with torch.inference_mode():
            set_attention_metadata(meta)
            set_state_metadata(padding_state_metadata(1, tokens, self.device))
            hidden = self.model(ids, pos)
            self.model.compute_logits(hidden[-self.config.max_num_seqs :]).float()
            set_attention_metadata(None)
            set_state_metadata(None)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        used_elsewhere = total - free - torch.cuda.memory_reserved(self.device)
        budget = total * self.config.gpu_memory_utilization - peak - used_elsewhere
        del hidden
        log.info(
            "weights and activations peak at %.1f GiB of %.1f GiB; %.2f GiB left for caches",
            peak / 2**30,
            total / 2**30,
            budget / 2**30,
        )
        return budget

    def _allocate_kv_cache(self) -> None:
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        for layer in self.model.attention_layers():
            layer.k_cache = torch.empty(shape, dtype=self.dtype, device=self.device)
            layer.v_cache = torch.empty(shape, dtype=self.dtype, device=self.device)

    # -- CUDA graphs and kernel warm-up ----------------------------------------------------------

    def capture_cudagraphs(self, max_model_len: int) -> None:
        """Compile every prefill-attention variant a step can pick, then capture one graph per
        decode batch size (model forward and logits; a decode step of n sequences replays the
        smallest graph of at least n rows, padded) and per short prefill bucket."""
        if self.device.type != "cuda":
            return
        max_blocks = -(-max_model_len // self.block_size)
        self._warm_up_prefill_attention(max_blocks * self.block_size)
        if self.config.enforce_eager:
            return
        sizes = sorted(
            set(
                self.config.cudagraph_capture_sizes
                or default_capture_sizes(self.config.max_num_seqs)
            )
        )
        self.graphs.capture(
            self.model, self.device, sizes, max_blocks, stateful=self.state is not None
        )
        # Short prefill and mixed steps: dense models only (a hybrid model's chunked GDN
        # prefill plans its chunks on the host).
        max_tokens = min(self.config.prefill_graph_max_tokens, self.max_num_batched_tokens)
        if self.state is None and max_tokens > 0:
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

    def _warm_up_prefill_attention(self, max_context: int) -> None:
        """Which prefill-attention kernel a step compiles depends on its chunk lengths, batch and
        context (short or long settings, heads per program, split-KV or not): compile them all
        now, so no request's first token waits for a compile (W3's 61 requests at once did: a
        variant first seen in the timed step cost about 2 s)."""
        from atom_kernels import prefill_attention

        layer = self.model.attention_layers()[0]
        launches = prefill_attention.reachable_launches(
            num_heads=layer.num_heads,
            num_kv_heads=layer.num_kv_heads,
            head_dim=layer.head_dim,
            page_size=self.block_size,
            max_num_seqs=self.config.max_num_seqs,
            max_tokens=self.max_num_batched_tokens,
            max_context=max_context,
            num_multiprocessors=torch.cuda.get_device_properties(self.device).multi_processor_count,
        )
        width = (layer.num_heads + 2 * layer.num_kv_heads) * layer.head_dim
        with torch.inference_mode():
            failed = prefill_attention.warm_up(
                layer.k_cache, layer.v_cache, layer.num_heads, width, layer.scale, launches
            )
        torch.cuda.synchronize(self.device)
        log.info("compiled %d prefill attention variants", len(launches) - len(failed))
        for launch, exc in failed:
            log.warning("prefill attention variant %s did not build: %s", launch, exc)

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

    def _pending_sources(self, rows: list[int], seqs: list[Sequence]) -> np.ndarray:
        """For input rows holding a pending token: where the last step's samples hold it."""
        if self._last_token_ids is None:
            raise RuntimeError("a pending token with no step in flight to take it from")
        where = {id(seq): i for i, seq in enumerate(self._last_samplers)}
        try:
            sources = [where[id(seq)] for seq in seqs]
        except KeyError:
            raise RuntimeError("a pending token the last step did not sample") from None
        return np.array([rows, sources], dtype=np.int64)

    def _fill_pending(self, input_ids: torch.Tensor, pending_sources: np.ndarray) -> None:
        """Copy tokens sampled by the last step, still on the device, into this step's inputs."""
        idx = to_device(pending_sources, self.device)
        input_ids.index_copy_(0, idx[0], self._last_token_ids.index_select(0, idx[1]))

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor | None:
        """fp32 logits of the sample rows ([S, vocab]), or None when no row samples. Under tensor
        parallelism every rank calls this with the same inputs (the layers' collectives pair up).
        The batch's checkpoint copies run first, eagerly (outside any CUDA graph)."""
        if inputs.state_copy is not None:
            self.copy_state(inputs.state_copy)
        if inputs.decode_only and self.graphs:
            logits = self.graphs.replay(inputs, self._fill_pending)
            if logits is not None:
                rows = inputs.sample_rows
                if len(rows) == len(inputs.input_ids):
                    return logits
                # A one-token prompt chunk short of the prompt's end is decode-shaped but does
                # not sample: keep only the sample rows.
                return logits[to_device(rows, self.device)] if len(rows) else None
        if not inputs.decode_only and self.prefill_graphs:
            logits = self.prefill_graphs.replay(inputs, self._fill_pending)
            if logits is not None:
                return logits if len(logits) else None
        dev = self.device
        decode_only = inputs.decode_only
        host = {
            "slot_mapping": inputs.slot_mapping,
            "block_tables": inputs.block_tables,
            "seq_lens": inputs.seq_lens,
            "cu_seqlens_q": inputs.cu_seqlens_q,
            "input_ids": inputs.input_ids,
            "positions": inputs.positions,
            "sample_rows": inputs.sample_rows,
        }
        if inputs.state_slots is not None:
            host["state_slots"] = inputs.state_slots
            host["has_initial_state"] = inputs.has_initial_state
        # One pinned staging buffer and one copy for the whole step (device.to_device_many).
        d = dict(zip(host, to_device_many(list(host.values()), dev), strict=True))
        fresh = None if decode_only else fresh_chunk_lengths(inputs.cu_seqlens_q, inputs.seq_lens)
        meta = AttentionMetadata(
            slot_mapping=d["slot_mapping"],
            block_tables=d["block_tables"],
            seq_lens=d["seq_lens"],
            decode_only=decode_only,
            cu_seqlens_q=None if decode_only else d["cu_seqlens_q"],
            max_seqlen_q=inputs.max_seqlen_q,
            fresh_chunks=fresh,
            dense_rows=self._dense_rows(fresh),
        )
        input_ids = d["input_ids"]
        if inputs.pending_sources is not None:
            self._fill_pending(input_ids, inputs.pending_sources)
        positions = d["positions"]
        rows = d["sample_rows"]
        set_attention_metadata(meta)
        if inputs.state_slots is not None:
            set_state_metadata(
                StateMetadata(
                    query_start_loc=d["cu_seqlens_q"],
                    slot_ids=d["state_slots"],
                    has_initial_state=d["has_initial_state"],
                )
            )
        try:
            hidden = self.model(input_ids, positions)
        finally:
            set_attention_metadata(None)
            set_state_metadata(None)
        if len(inputs.sample_rows) == 0:
            return None
        return self.model.compute_logits(hidden[rows]).float()

    def sample(self, logits: torch.Tensor, samplers: list[Sequence]) -> SamplerOutput:
        """One token per sampling sequence (rows of `logits` in the order of `samplers`)."""
        return self.sampler(logits, samplers, self.eos_token_ids)

    def prepare_inputs(self, batch: ScheduledBatch) -> tuple[StepInputs, list[Sequence]]:
        """The batch as host arrays, and the sequences that sample this step (in row order)."""
        inputs, samplers = self._prepare_inputs(batch)
        if batch.state_copy is not None:
            inputs.state_copy = np.asarray(batch.state_copy, dtype=np.int64)
        return inputs, samplers

    def _prepare_inputs(self, batch: ScheduledBatch) -> tuple[StepInputs, list[Sequence]]:
        self._prompt_jobs, self._sampler_pos = [], None
        if all(n == 1 for n in batch.num_new_tokens) and not any(
            seq.wants_prompt_lp and seq.num_computed_tokens < seq.num_prompt_tokens - 1
            for seq in batch.seqs
        ):
            return self._prepare_decode(batch.seqs)
        bs = self.block_size
        ids_parts, pos_parts, slot_parts = [], [], []
        seq_lens, q_lens, sample_rows, samplers, sampler_pos = [], [], [], [], []
        pending_rows, pending_seqs = [], []
        offset = 0
        max_blocks = max(len(seq.block_table) for seq in batch.seqs)
        tables = np.zeros((len(batch.seqs), max_blocks), dtype=np.int32)
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
            start = seq.num_computed_tokens
            end = start + n
            ids_parts.append(np.frombuffer(seq.token_ids, dtype=np.int32)[start:end])
            pos = np.arange(start, end, dtype=np.int64)
            table = np.frombuffer(seq.block_table, dtype=np.int32)  # a view, no copy
            tables[i, : len(table)] = table
            pos_parts.append(pos)
            slot_parts.append(table[pos // bs].astype(np.int64) * bs + pos % bs)
            seq_lens.append(end)
            q_lens.append(n)
            offset += n
            if seq.num_pending and end > seq.num_tokens - seq.num_pending:
                # Only a decode row reaches a pending token, and only the oldest one.
                if n != 1 or end != seq.num_tokens - seq.num_pending + 1:
                    raise RuntimeError(f"{seq!r}: a chunk runs over tokens not yet sampled")
                pending_rows.append(offset - 1)
                pending_seqs.append(seq)
            wanted = seq.prompt_lp_wanted(start, end)
            if wanted:  # logits rows for prompt_logprobs (always before the sampling row)
                first = offset - n + wanted.start - start
                self._prompt_jobs.append((seq, wanted.start, len(sample_rows), len(wanted)))
                sample_rows.extend(range(first, first + len(wanted)))
            if end == seq.num_tokens:  # the chunk reaches the last known token: sample
                sampler_pos.append(len(sample_rows))
                sample_rows.append(offset - 1)
                samplers.append(seq)
        cu = np.zeros(len(q_lens) + 1, dtype=np.int32)
        np.cumsum(q_lens, out=cu[1:])
        inputs = StepInputs(
            input_ids=np.concatenate(ids_parts).astype(np.int64),
            positions=np.concatenate(pos_parts),
            slot_mapping=np.concatenate(slot_parts),
            block_tables=tables,
            seq_lens=np.asarray(seq_lens, dtype=np.int32),
            cu_seqlens_q=cu,
            max_seqlen_q=max(q_lens),
            sample_rows=np.asarray(sample_rows, dtype=np.int64),
        )
        if pending_rows:
            inputs.pending_sources = self._pending_sources(pending_rows, pending_seqs)
        if self.state is not None:
            self._add_state_rows(inputs, batch.seqs)
        if self._prompt_jobs:
            self._sampler_pos = sampler_pos
        return inputs, samplers

    def take_prompt_logprobs(self, logits: torch.Tensor | None) -> torch.Tensor | None:
        """Given the logits of the last prepared step's rows: record its prompt_logprobs in
        their sequences and return the sampling rows' logits (None when none samples)."""
        jobs, self._prompt_jobs = self._prompt_jobs, []
        if not jobs or logits is None:
            return logits
        for seq, first, at, count in jobs:
            lps = logits[at : at + count].log_softmax(dim=-1)
            targets = seq.token_ids[first + 1 : first + 1 + count]
            targets = torch.tensor(targets.tolist(), dtype=torch.int64, device=lps.device)
            picked = lps.gather(1, targets[:, None])
            ranks = ((lps > picked).sum(dim=-1) + 1).tolist()  # 1: the most likely token
            k = seq.sampling_params.prompt_logprobs
            ids, vals = [[]] * count, [[]] * count
            if k:
                top_lps, top_ids = lps.topk(k, dim=-1)
                ids, vals = top_ids.tolist(), top_lps.tolist()
            seq.prompt_lp.extend(zip(picked.squeeze(1).tolist(), ids, vals, ranks, strict=True))
        pos, self._sampler_pos = self._sampler_pos, None
        if not pos:
            return None
        return logits[torch.tensor(pos, dtype=torch.int64, device=logits.device)]

    def _prepare_decode(self, seqs: list[Sequence]) -> tuple[StepInputs, list[Sequence]]:
        """One new token per sequence: plain lists, no per-sequence numpy work (the hot path)."""
        bs = self.block_size
        pos = [s.num_computed_tokens for s in seqs]
        ids = [s.token_ids[p] for s, p in zip(seqs, pos, strict=True)]
        slots = [s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, pos, strict=True)]
        tables = np.zeros((len(seqs), max(len(s.block_table) for s in seqs)), dtype=np.int32)
        for i, s in enumerate(seqs):
            tables[i, : len(s.block_table)] = np.frombuffer(s.block_table, dtype=np.int32)
        rows = [i for i, (s, p) in enumerate(zip(seqs, pos, strict=True)) if p + 1 == s.num_tokens]
        positions = np.array(pos, dtype=np.int64)
        inputs = StepInputs(
            input_ids=np.array(ids, dtype=np.int64),
            positions=positions,
            slot_mapping=np.array(slots, dtype=np.int64),
            block_tables=tables,
            seq_lens=(positions + 1).astype(np.int32),
            cu_seqlens_q=np.arange(len(seqs) + 1, dtype=np.int32),
            max_seqlen_q=1,
            sample_rows=np.array(rows, dtype=np.int64),
        )
        if min(ids) == PENDING_TOKEN:
            pending = [i for i, t in enumerate(ids) if t == PENDING_TOKEN]
            inputs.pending_sources = self._pending_sources(pending, [seqs[i] for i in pending])
        if self.state is not None:
            self._add_state_rows(inputs, seqs)
        return inputs, [seqs[i] for i in rows]

    @staticmethod
    def _add_state_rows(inputs: StepInputs, seqs: list[Sequence]) -> None:
        """Each sequence's committed slot, and whether its state carries over: only once a
        chunk of this residency has run or a checkpoint restore put the state of its first
        num_computed_tokens into the slot (prefix hits resume only from checkpoints, and
        preemption resets the count, so a readmitted or slot-reusing sequence starts from zero
        state)."""
        if any(not seq.state_slots for seq in seqs):
            raise RuntimeError("a hybrid model's sequence was scheduled without a state slot")
        inputs.state_slots = np.array([seq.state_slots[0] for seq in seqs], dtype=np.int32)
        inputs.has_initial_state = np.array(
            [seq.num_computed_tokens > 0 for seq in seqs], dtype=np.bool_
        )

    def release(self, request_ids) -> None:
        self.sampler.release(request_ids)

    def shutdown(self) -> None:
        """Drop the KV cache, the captured graphs and the generators, so their memory is freed
        even while something still holds this runner."""
        for layer in self.model.attention_layers():
            layer.k_cache = layer.v_cache = torch.empty(0)
        if self.state is not None:
            self.state.release()
        self.graphs.clear()
        self.prefill_graphs.clear()
        self._last_samplers, self._last_token_ids = [], None
        self.sampler.generators.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

"""The model runner's memory: how many KV blocks (and, for hybrid models, state slots) fit, the
cache tensors themselves, and the state-checkpoint copy plan over them. On a GPU the budget is
what `gpu_memory_utilization` leaves after the weights and a profiling forward's peak; on CPU it
is ATOM_CPU_KVCACHE_SPACE GiB. The KV cache's dtype is the model's or, with `--kv-cache-dtype
fp8`, the platform's FP8 e4m3 (one byte a value: twice the blocks in the same memory), set on
each attention layer's cache spec.

KV groups (docs/kv-groups.md): when a model's sliding-window layers keep their blocks apart
(`ModelConfig.kv_window`), a block id is one block of the full-attention layers or one of the
window layers, never both. The layers then share cache tensors: the i-th full-attention layer
and the i-th window layer write tensor pair i, each in the blocks its group owns, so a block
costs max(full layers, window layers) layers' worth of memory, not the sum."""

from __future__ import annotations

import logging

import numpy as np
import torch

from atom_kernels.fp8_formats import fp8_dtype_for_platform
from atom_runtime import envs
from atom_runtime.layers.forward_context import (
    AttentionMetadata,
    padding_state_metadata,
    set_attention_metadata,
    set_state_metadata,
)
from atom_runtime.models.quant_config import KV_DTYPE_REFUSED
from atom_runtime.state.checkpoint_spec import (
    PagedStateCheckpointSpec,
    StatePoolPlan,
    StateTensorShape,
)
from atom_runtime.state.copy_plan import StateCopyPlan
from atom_runtime.state.maintenance import uint8_rows
from atom_runtime.state.slot_pool import plan_state_slots
from atom_runtime.system.distributed import all_reduce_min

log = logging.getLogger("atom_runtime.worker.model_runner")


class CacheMemory:
    """ModelRunner's part that sizes and allocates the caches (a mixin: it reads the runner's
    model, config, device, dtype and cache geometry)."""

    def _use_kv_cache_dtype(self, layers: list) -> torch.dtype:
        """The KV cache dtype `--kv-cache-dtype` asks for, set on every attention layer (its
        cache spec and k/v scales). Multi-head latent attention's cache is refused in FP8: its
        kernels have no FP8 path yet."""
        if self.config.kv_cache_dtype == "auto":
            return self.dtype
        if not all(hasattr(layer, "use_kv_cache_dtype") for layer in layers):
            raise ValueError(
                KV_DTYPE_REFUSED.format(
                    dtype=self.config.kv_cache_dtype, model=self.model_config.model_type
                )
            )
        dtype = fp8_dtype_for_platform(self.device)
        for layer in layers:
            layer.use_kv_cache_dtype(dtype)
        scaled = sum(bool(layer.checkpoint_kv_scales) for layer in layers)
        log.info(
            "KV cache in %s: k/v scales from the checkpoint for %d of %d layers, 1.0 elsewhere",
            str(dtype).removeprefix("torch."), scaled, len(layers),
        )  # fmt: skip
        return dtype

    def kv_layers(self) -> list:
        """Every paged attention layer the cache serves: the model's, then a drafting model's
        (speculative decoding), which index the same block ids."""
        drafter = getattr(self, "drafter", None)
        extra = drafter.attention_layers() if drafter is not None else []
        return [*self.model.attention_layers(), *extra]

    @property
    def bytes_per_block(self) -> int:
        """One block of every cache tensor, as each layer's `cache_spec` says (K and V per KV
        head, or one latent row a token for MLA). With KV groups the layers of one pair share
        tensors (`_cache_pairs`): a pair counts once."""
        return self._block_bytes(self._cache_pairs())

    def _block_bytes(self, pairs: list[list]) -> int:
        per_token = sum(pair[0].cache_spec().bytes_per_token(self.dtype) for pair in pairs)
        return self.block_size * per_token

    def _cache_pairs(self) -> list[list]:
        """The attention layers by the cache tensors they write: one layer each, or with KV
        groups the i-th layer of each group on the same tensors; a drafting model's layers
        (speculative decoding) one each."""
        attn = self.model.attention_layers()
        drafted = [[layer] for layer in self.kv_layers()[len(attn) :]]
        if self.model_config.kv_window is None:
            return [[layer] for layer in attn] + drafted
        full = [layer for layer in attn if not layer.sliding_window]
        window = [layer for layer in attn if layer.sliding_window]
        pairs = [[] for _ in range(max(len(full), len(window)))]
        for group in (full, window):
            for i, layer in enumerate(group):
                pairs[i].append(layer)
        return pairs + drafted

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
        space = envs.CPU_KVCACHE_SPACE.number() * (1 << 30)
        return max(1, int(space // self.bytes_per_block))

    def _plan_hybrid_memory(self, override: int | None) -> int:
        """Split the cache budget (GPU: what is left after weights and the peak activation;
        CPU: ATOM_CPU_KVCACHE_SPACE) between state slots and KV blocks (`plan_state_slots`)."""
        if self.device.type == "cuda":
            budget = self._profile_gpu_budget()
        else:
            budget = envs.CPU_KVCACHE_SPACE.number() * (1 << 30)
        # A sequence holds slots_per_request slots (speculative decoding: one per verified
        # position), planned as one unit.
        per_request = self.state_slots_per_request
        plan = plan_state_slots(
            budget,
            self.state.bytes_per_slot * per_request,
            self.bytes_per_block,
            self.config.max_num_seqs,
            fixed_blocks=override,
        )
        if plan.num_blocks < 1:
            raise RuntimeError(
                f"no room for the KV cache next to {plan.num_slots * per_request} state slots: "
                "raise --gpu-memory-utilization or lower --max-num-seqs"
            )
        self._planned_slots = plan.num_slots * per_request
        return plan.num_blocks

    def _allocate_state_slots(self) -> None:
        """Allocate the slots every rank agreed on; cap max_num_seqs to them (a running sequence
        holds `state_slots_per_request`)."""
        self.num_state_slots = all_reduce_min(self._planned_slots, self.device)
        self.state.allocate(self.num_state_slots)
        fit = self.num_state_slots // self.state_slots_per_request
        if self.config.max_num_seqs > fit:
            log.warning(
                "max_num_seqs capped from %d to %d: the state slots that fit in memory",
                self.config.max_num_seqs,
                fit,
            )
            self.config.max_num_seqs = fit
        log.info(
            "hybrid state: %d slots of %.2f MiB each (%d stateful layers, recurrent state in "
            "%s), %.2f GiB in all",
            self.num_state_slots,
            self.state.bytes_per_slot / 2**20,
            len(self.state.layers),
            str(self.state.ssm_dtype).removeprefix("torch."),
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
            self.block_size, len(attn), self.num_kv_heads, self.head_dim, self.kv_cache_dtype,
            tuple(shapes),
        )  # fmt: skip
        spec = PagedStateCheckpointSpec.from_plan(plan)
        # The target model's layers: a drafting model's (speculative decoding) share the block
        # ids but are not in the checkpoint's PAGE unit.
        drafted = len(self.kv_layers()) - len(attn)
        pairs = self._cache_pairs()
        block_bytes = self._block_bytes(pairs[: len(pairs) - drafted])
        if spec.page_unit_bytes != block_bytes:
            raise RuntimeError(
                f"state checkpoint PAGE unit ({spec.page_unit_bytes} bytes) differs from a KV "
                f"block of the cache specs ({block_bytes} bytes)"
            )
        if spec.image_bytes != self.state.bytes_per_slot:
            raise RuntimeError(
                f"state checkpoint image ({spec.image_bytes} bytes) differs from the slot "
                f"({self.state.bytes_per_slot} bytes)"
            )
        pool_segments = [uint8_rows(t) for layer in attn for t in layer.cache_tensors()]
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
        host_cu = np.array([0, tokens], dtype=np.int32)
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
            host_cu_seqlens_q=host_cu,
            host_seq_lens=host_cu[1:],
            host_block_tables=np.zeros((1, blocks_wide), dtype=np.int32),
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
        """Each attention layer's cache tensors, `[num_blocks, block_size, *token_shape]` as its
        `cache_spec` lists them, bound to the layer (the layers of a KV-group pair share them:
        their specs are one)."""
        for layers in self._cache_pairs():
            spec = layers[0].cache_spec()
            # Zeros on a GPU: a captured verify step lengthens a sequence over its padded rows,
            # so its real rows load key/value slots no step has written yet (weighted zero by
            # the causal mask), and bytes left by the allocator's earlier tensors can be NaN in
            # FP8 (0x7f, 0xff): zero times NaN is NaN. Eager steps (all a CPU runs) read only
            # written slots, and a CPU cache's pages are committed only as they are used.
            zeroed = self.device.type != "cpu"
            tensors = spec.allocate(
                self.num_blocks, self.block_size, self.dtype, self.device, zeroed=zeroed
            )
            for layer in layers:
                if layer.cache_spec() != spec:
                    raise RuntimeError("layers sharing cache tensors need one cache spec")
                layer.bind_cache(tensors)

    def _release_kv_cache(self) -> None:
        """Unbind every layer's cache tensors and drop the checkpoint copy plan, which holds byte
        views of them (and of the state slots)."""
        self._copy_plan = None
        for layer in self.kv_layers():
            layer.bind_cache([torch.empty(0) for _ in layer.cache_spec().tensors])

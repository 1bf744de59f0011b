"""EngineCore: the scheduler and the model runner in one loop.

One step: `schedule()` -> `executor.execute(batch)` (launched on the device) -> `Scheduler.commit`
(its tokens count as computed; each sampling sequence gets a pending token) -> read the samples
back -> `Scheduler.update_from_output` (fill the pending tokens in, check stops, publish computed
blocks, free finished) -> publish KV events -> outputs.

With async scheduling the read-back of step N waits until step N+1 has been scheduled and
launched, so the CPU prepares N+1 while the GPU runs N: step N+1's inputs take the tokens step
N sampled straight from the device, and each call returns the previous step's outputs. A
sequence whose pending token ends it by length is not scheduled again; one that stops on a
token runs one wasted row, whose result is dropped. A sequence whose next step needs its last
token (penalties, a grammar's mask) sits out the steps prepared while that token is in flight;
so does a speculating sequence while any step of it is, and its drafts are proposed as soon as
that step completes (docs/speculative-decoding.md, "With async scheduling").

The same class runs in-process under `LLM` and in its own process under `atom serve`. `executor`
(an executor.Executor) is the ModelRunner itself, or with `tensor_parallel_size > 1` rank 0 of a
TPExecutor that drives one worker process per other rank; the scheduler and block manager exist
only here.
"""

from __future__ import annotations

import json
import logging
from array import array
from dataclasses import dataclass
from pathlib import Path

import torch

from atom_runtime.config import EngineConfig
from atom_runtime.core.batch import ScheduledBatch, StepOutput
from atom_runtime.core.block_manager import BlockManager
from atom_runtime.core.block_pool import BlockPool
from atom_runtime.core.scheduler import Scheduler, request_update
from atom_runtime.core.sequence import Sequence, SequenceStatus
from atom_runtime.kv_events import KVEventsConfig, make_publisher
from atom_runtime.kv_transfer import make_transfer_agent
from atom_runtime.models.preflight import preflight
from atom_runtime.protocol.block_hash import salt_root
from atom_runtime.protocol.engine_core import (
    EngineRequest,
    EngineStats,
    RequestUpdate,
    StepOutputs,
    check_token_ids,
)
from atom_runtime.sampling_params import SamplingParams
from atom_runtime.spec_decode.proposer import StepRecord
from atom_runtime.state.engine_checkpoints import EngineCheckpoints
from atom_runtime.state.slot_pool import StateSlotPool
from atom_runtime.system import startup
from atom_runtime.system.process import return_free_memory
from atom_runtime.system.threads import configure_cpu_threads
from atom_runtime.text.structured_outputs import Guides
from atom_runtime.worker.executor import make_executor
from atom_runtime.worker.sampler import SamplerOutput
from atom_runtime.worker.verify_sampler import flatten_verified

log = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, prebuild_guides: bool = False) -> None:
        """`prebuild_guides`: build the structured-outputs tokenizer while the model loads (the
        engine-core process does; its build holds the GIL for a second or more, which would
        otherwise stall every stream when the first guided request arrives)."""
        self.config = config
        self.startup = startup.restart()
        with self.startup.phase("config"):
            # The cheap checks (models/preflight.py) before any worker starts or weight is read.
            checked = preflight(config)
            self.model_path, self.model_config = checked.path, checked.config
            configure_cpu_threads(config.cpu_threads, config.tensor_parallel_size)
            self.kv_events_config = KVEventsConfig.from_cli(config.kv_events_config)
        self.eos_token_ids = _eos_token_ids(self.model_path, self.model_config.eos_token_ids)
        self.guides = Guides(str(self.model_path), self.model_config.vocab_size, self.eos_token_ids)
        if prebuild_guides:
            self.guides.start_building()
        self.executor = make_executor(config, self.model_config, self.model_path)
        try:
            self._finish_init(config)
        except BaseException:
            self.executor.shutdown()  # tensor-parallel workers must not outlive a failed start
            raise
        self.guides.wait()  # built before the first request can run

    def _finish_init(self, config: EngineConfig) -> None:
        self.executor.eos_token_ids = self.eos_token_ids
        self.block_size = config.block_size
        self.max_model_len = self._decide_max_model_len()
        self.executor.capture_cudagraphs(self.max_model_len)
        self.max_num_batched_tokens = self.executor.max_num_batched_tokens
        self.pool = BlockPool(
            self.executor.num_blocks,
            config.block_size,
            enable_events=self.kv_events_config.enable_kv_cache_events,
            medium="CPU" if self.executor.device.type == "cpu" else "GPU",
            event_token_ids=self.kv_events_config.include_token_ids,
        )
        hybrid = self.model_config.is_hybrid
        # Speculative decoding (docs/speculative-decoding.md): a hybrid sequence holds a state
        # slot per verified position.
        self.speculative = config.speculative()
        k = self.speculative.num_speculative_tokens if self.speculative else 0
        self.state_pool = StateSlotPool(self.executor.num_state_slots, 1 + k) if hybrid else None
        prefix_caching = config.enable_prefix_caching
        self.checkpoints: EngineCheckpoints | None = None
        if hybrid and prefix_caching:
            if config.state_checkpoint_interval_tokens == 0:
                # A KV prefix hit without the recurrent state at that point cannot be resumed.
                log.info(
                    "prefix caching is off for %s: prefix reuse for hybrid models needs state "
                    "checkpoints (--state-checkpoint-interval-tokens is 0)",
                    self.model_config.model_type,
                )
                prefix_caching = False
            else:
                self.checkpoints = EngineCheckpoints(
                    self.pool,
                    self.executor.checkpoint_spec,
                    self.executor.num_state_slots,
                    config.state_checkpoint_interval_tokens,
                    config.state_checkpoint_demand,
                    max_units=int(self.pool.num_blocks * config.state_checkpoint_memory_fraction),
                )
        _warn_checkpoint_flags(config, hybrid)
        self.scheduler = Scheduler(
            BlockManager(self.pool, prefix_caching, sliding_window=self.model_config.kv_window),
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            eos_token_ids=self.eos_token_ids,
            state_pool=self.state_pool,
            checkpoints=self.checkpoints,
            num_speculative_tokens=k,
            spec_lookahead=self.speculative.lookahead if self.speculative else 0,
        )
        self.publisher = make_publisher(self.kv_events_config, config.data_parallel_rank)
        # Prefill/decode disaggregation: holds (producer) and pulls (consumer) of KV blocks.
        self.kv_transfer = make_transfer_agent(
            config, self.scheduler.block_manager, self.executor, self.model_config, self.checkpoints
        )
        if self.kv_transfer is not None:
            # A producer holds a finished prompt's blocks before the scheduler frees them.
            self.scheduler.on_finish = self.kv_transfer.on_finished
        self.async_scheduling = config.async_scheduling
        if self.async_scheduling is None:
            # Speculating, only when asked for: a speculating sequence runs every other step
            # while its own is in flight, and the gain is unmeasured.
            self.async_scheduling = (
                self.executor.device.type == "cuda"
                and config.tensor_parallel_size == 1
                and self.speculative is None
            )
        self._in_flight: _InFlight | None = None
        with self.startup.phase("warm_up"):
            self._warm_up()

    def _warm_up(self) -> None:
        """Run one short request through a prefill and a decode step before serving, so the first
        real request does not pay for kernel compilation. It stays under one block, so it leaves
        no hash, no KV event and no prefix-cache entry; the counters are reset afterwards."""
        # Prompt + the one computed output token stay below a full block: nothing gets hashed.
        n = min(self.block_size - 2, self.max_model_len - 3)
        if n < 2:
            return
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        self.add_request(EngineRequest("__atom_warm_up__", list(range(1, n + 1)), params))
        while self.has_unfinished_requests():
            self.step()
        if self.pool.num_free_blocks != self.pool.num_blocks or self.pool.holds_hashes:
            raise RuntimeError("warm-up left blocks or cached hashes behind")
        if self.state_pool is not None and self.state_pool.num_in_use:
            raise RuntimeError("warm-up left state slots behind")
        self.scheduler.reset_counters()
        if self.checkpoints is not None:
            if self.checkpoints.store.units_in_use:
                raise RuntimeError("warm-up left state checkpoints behind")
            self.checkpoints.counters.__init__(pool_units=self.pool.num_blocks)

    def _decide_max_model_len(self) -> int:
        cache_tokens = self.executor.num_blocks * self.block_size
        model_len = self.model_config.max_position_embeddings
        wanted = self.config.max_model_len
        if wanted is not None:
            if wanted > model_len:
                raise ValueError(
                    f"max_model_len: {wanted} exceeds the model's context length {model_len}"
                )
            if wanted > cache_tokens:
                raise ValueError(
                    f"max_model_len: {wanted} tokens do not fit the KV cache ({cache_tokens} "
                    "tokens); lower it or give the cache more memory"
                )
            return wanted
        if model_len > cache_tokens:
            log.warning("max_model_len capped to %d tokens by the KV cache size", cache_tokens)
        return min(model_len, cache_tokens)

    # -- requests --------------------------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> None:
        """Validate and queue a request, its grammar compiled on this thread (`LLM`, warm-up);
        the engine-core process compiles off its loop instead (engine/grammar_compiler.py).
        Bad input raises ValueError naming the field; nothing is queued then."""
        self.admit(self.prepare(request), self.compile_grammar(request))

    def prepare(self, request: EngineRequest) -> Sequence:
        """Every check of a request but its grammar's, and its Sequence; changes nothing."""
        self._check_new_id(request.request_id)
        if not request.prompt_token_ids:
            raise ValueError("prompt: must contain at least one token")
        vocab = self.model_config.vocab_size
        try:
            # The prompt's one conversion (the Sequence copies an array at memcpy speed), then
            # checked in one numpy pass.
            prompt = array("i", request.prompt_token_ids)
        except (OverflowError, TypeError):
            check_token_ids("prompt", request.prompt_token_ids, vocab)  # names the bad id
            raise
        check_token_ids("prompt", prompt, vocab)
        if len(prompt) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(prompt)} tokens leave no room to generate within the context "
                f"length of {self.max_model_len} tokens"
            )
        params = request.sampling_params
        for field, ids in params.token_ids_named().items():
            check_token_ids(field, ids, vocab)
        if params.max_tokens is not None and len(prompt) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens: {params.max_tokens} + {len(prompt)} prompt tokens exceed the "
                f"context length of {self.max_model_len} tokens"
            )
        seq = Sequence(request.request_id, prompt, params, request.arrival_time or None)
        if request.cache_salt is not None:
            if not isinstance(request.cache_salt, str) or not request.cache_salt:
                raise ValueError("cache_salt: must be a non-empty string")
            seq.hash_root = salt_root(request.cache_salt)
        if request.kv_transfer_params is not None:
            if self.kv_transfer is None:
                raise ValueError(
                    "kv_transfer_params: this engine transfers no KV (no --kv-transfer-config)"
                )
            seq.kv_transfer_params = self.kv_transfer.open_params(request.kv_transfer_params)
        return seq

    def compile_grammar(self, request: EngineRequest):
        """The request's grammar matcher (None when unguided); slow for a big grammar, and safe
        on any thread. Raises ValueError naming the field when it does not compile."""
        spec = request.sampling_params.structured_outputs
        return self.guides.matcher(spec) if spec is not None else None

    def admit(self, seq: Sequence, matcher) -> None:
        """Queue a prepared request: parked for its KV pull, or to the scheduler."""
        self._check_new_id(seq.request_id)  # it may have arrived while this one compiled
        seq.matcher = matcher
        if self.checkpoints is not None:
            self.checkpoints.placement.schedulability_warning(
                seq.request_id,
                seq.num_prompt_tokens + (seq.sampling_params.max_tokens or 0),
                self.pool.num_blocks,
                self.checkpoints.spec.units_per_image,
            )
        parked = self.kv_transfer is not None and self.kv_transfer.park(seq)
        if not parked:  # a parked request enters the scheduler once its KV pull is over
            self.scheduler.add(seq)

    def _check_new_id(self, request_id: str) -> None:
        if request_id in self.scheduler.requests or (
            self.kv_transfer is not None and self.kv_transfer.is_parked(request_id)
        ):
            raise ValueError(f"request_id: {request_id!r} is already running")

    def abort_requests(self, request_ids) -> list[RequestUpdate]:
        ids = set(request_ids)
        aborted = self.scheduler.abort(ids)
        if self.kv_transfer is not None:
            aborted += self.kv_transfer.abort(ids)
        return [request_update(seq, with_token=False) for seq in aborted]

    def has_unfinished_requests(self) -> bool:
        # A step in flight counts while it holds a live sequence (not once all were aborted).
        # So do checkpoint copies queued for finished requests (their last decode anchor, say):
        # one more step runs them alone, or they would wait for the next request to arrive.
        return (
            self.scheduler.has_unfinished()
            or (self.checkpoints is not None and self.checkpoints.maint.needs_flush)
            or (
                self._in_flight is not None
                and not all(seq.is_finished for seq in self._in_flight.batch.seqs)
            )
            or (self.kv_transfer is not None and self.kv_transfer.has_work())
        )

    # -- the loop --------------------------------------------------------------------------------

    def step(self) -> StepOutputs:
        outputs = StepOutputs()
        if self.kv_transfer is not None:
            for seq in self.kv_transfer.poll():
                self.scheduler.add(seq)
            if not self.scheduler.has_unfinished() and self._in_flight is None:
                # Only transfers are pending: sleep until the transport has news, briefly.
                self.kv_transfer.wait(0.005)
        flush = self.scheduler.flush_checkpoint_copies()
        if flush is not None:
            if flush.state_copy is not None:
                self.executor.copy_state(flush.state_copy)
            self.scheduler.batch_done(flush)
        batch = self.scheduler.schedule()
        launched = self._launch(batch) if batch else None
        if not batch and batch.state_copy is not None:
            # Nothing to schedule, but copies hold slots admission waits for: run them alone.
            self.executor.copy_state(batch.state_copy)
            self.scheduler.batch_done(batch)
        if self._in_flight is not None:
            outputs = self._complete(self._in_flight)
        self._in_flight = launched
        if launched is not None and not self.async_scheduling:
            outputs = self._complete(launched)  # nothing was in flight: the only outputs
            self._in_flight = None
        self.publisher.publish(self.pool.drain_events())
        self.publisher.raise_if_failed()
        return outputs

    def _launch(self, batch: ScheduledBatch) -> _InFlight:
        """Run the batch on the device and commit it; the samples start their way back to the
        host. Speculating under async scheduling, the step's drafting record is kept with it:
        its drafts are proposed once it completes, after the next step was launched."""
        samplers, sampled = self.executor.execute(batch)
        self.scheduler.commit(batch, samplers)
        record = None
        if self.speculative is not None and self.async_scheduling:
            record = self.executor.step_record()
        return _InFlight.start(batch, samplers, sampled, record)

    def _complete(self, step: _InFlight) -> StepOutputs:
        """Read a launched step's samples back, hand them to the scheduler and, speculating,
        propose drafts for its sequences before any of them is scheduled again."""
        outputs, _ = self.scheduler.update_from_output(step.batch, step.wait())
        if self.speculative is not None:
            self._propose(step)
        return outputs

    def _propose(self, step: _InFlight) -> None:
        """Drafts for the step's sequences still running, for their next step to verify. A
        speculating sequence sits out the steps launched while its step was in flight
        (`Scheduler._sits_out`), so none of them has another step in flight here."""
        live = [seq for seq in step.batch.seqs if seq.status is SequenceStatus.RUNNING]
        if any(seq.steps_in_flight for seq in live):
            raise RuntimeError("drafts proposed for a sequence with a step in flight")
        if live:
            proposed = self.executor.propose(live, step.record)
            for seq, drafts in zip(live, proposed, strict=True):
                seq.spec_token_ids = drafts
                seq.draft_kv_from = None  # the catch-up covered it (or, an MTP head, cannot)

    # -- introspection ---------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            kv_cache_usage=self.pool.usage,
            num_blocks=self.pool.num_blocks,
            block_size=self.block_size,
            prefix_queries=s.prefix_queries,
            prefix_hits=s.prefix_hits,
            num_preemptions=s.num_preemptions,
            prompt_tokens=s.prompt_tokens,
            generation_tokens=s.generation_tokens,
            kv_events_published=self.publisher.published_total,
            kv_events_dropped=self.publisher.dropped_total,
            state_slots_total=self.state_pool.num_slots if self.state_pool else 0,
            state_slots_in_use=self.state_pool.num_in_use if self.state_pool else 0,
            state_slot_bytes=self.executor.state_bytes_per_slot if self.state_pool else 0,
            kv_transfer=self.kv_transfer.snapshot() if self.kv_transfer is not None else None,
            state_checkpoints=self.checkpoints.counters if self.checkpoints else None,
            spec_decoding=s.spec_stats,
        )

    def cached_block_hashes(self) -> list[int]:
        return sorted(self.pool.cached)

    def reset_prefix_cache(self) -> bool:
        # Lent blocks count as in use: checkpoints go first (False while one is pinned or its
        # copy is in flight; the pool then refuses too).
        if self.checkpoints is not None and not self.checkpoints.store.invalidate_all():
            return False
        ok = self.pool.reset_prefix_cache()
        if ok:
            self.publisher.publish(self.pool.drain_events())
        return ok

    def shutdown(self) -> None:
        if self.kv_transfer is not None:
            self.kv_transfer.close()
        self.publisher.shutdown()
        self.executor.shutdown()
        return_free_memory()  # the CPU KV cache's pages, which glibc would otherwise keep


@dataclass
class _InFlight:
    """A launched step: its batch, its sampling sequences and their samples on their way back."""

    batch: ScheduledBatch
    samplers: list[Sequence]
    sampled: SamplerOutput | None
    done: torch.cuda.Event | None
    # What the step leaves its drafter (`ModelRunner.step_record`); None: the runner's latest.
    record: StepRecord | None = None

    @classmethod
    def start(
        cls, batch, samplers, sampled: SamplerOutput | None, record: StepRecord | None = None
    ) -> _InFlight:
        done = None
        if sampled is not None and sampled.token_ids.is_cuda:
            # non_blocking copies to the host land in pinned memory; the event marks them done.
            sampled = SamplerOutput(
                *(
                    None if t is None else t.to("cpu", non_blocking=True)
                    for t in (
                        sampled.token_ids,
                        sampled.logprobs,
                        sampled.top_ids,
                        sampled.top_logprobs,
                        sampled.num_tokens,
                    )
                ),
                drafts=sampled.drafts,
            )
            done = torch.cuda.Event()
            done.record()
        return cls(batch, samplers, sampled, done, record)

    def wait(self) -> StepOutput | None:
        """The samples as host lists (None when no sequence sampled)."""
        if not self.samplers:
            return None
        if self.done is not None:
            self.done.synchronize()
        s = self.sampled
        if s.num_tokens is not None or s.drafts is not None:  # a verify step: a row per token
            counts, *rows = flatten_verified(s)
            return StepOutput(self.samplers, *rows, num_tokens=counts)
        return StepOutput(
            self.samplers,
            *(
                None if t is None else t.tolist()
                for t in (s.token_ids, s.logprobs, s.top_ids, s.top_logprobs)
            ),
        )


def _warn_checkpoint_flags(config: EngineConfig, hybrid: bool) -> None:
    """Non-hybrid models hold no recurrent state: a checkpoint setting other than the defaults
    (-1, demand unset or on) has no effect, say so instead of failing (the operator renders
    the flags for every deployment). Hybrid models with prefix caching off are told too."""
    flags = []
    if config.state_checkpoint_interval_tokens > 0:
        flags.append(
            f"--state-checkpoint-interval-tokens={config.state_checkpoint_interval_tokens}"
        )
    if config.state_checkpoint_demand is False:
        flags.append("--no-state-checkpoint-demand")
    if config.state_checkpoint_memory_fraction != EngineConfig.state_checkpoint_memory_fraction:
        flags.append(
            f"--state-checkpoint-memory-fraction={config.state_checkpoint_memory_fraction:g}"
        )
    if hybrid:
        if not config.enable_prefix_caching and config.state_checkpoint_interval_tokens != 0:
            log.info("state checkpoints are off: prefix caching is disabled")
        return
    if flags:
        log.warning(
            "%s has no effect: the model holds no recurrent state (only hybrid models use "
            "state checkpoints)",
            ", ".join(flags),
        )


def _eos_token_ids(model_path: Path, from_config: list[int]) -> list[int]:
    """EOS ids from config.json, plus generation_config.json's when the folder has one."""
    ids = set(from_config)
    folder = model_path if model_path.is_dir() else model_path.parent
    gen = folder / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if eos is not None:
            ids.update([eos] if isinstance(eos, int) else eos)
    return sorted(ids)

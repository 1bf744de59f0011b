"""CUDA graphs for decode steps: one captured forward (model and logits) per batch size.

A decode-only step of n sequences replays the smallest graph of at least n rows, its rows past n
padded (attending to nothing, writing no cache slot). The graphs read their inputs from fixed
device buffers; a step fills one of two pinned host staging sets and copies it into them
asynchronously, so the host does not wait for the device to take an input unless it comes
round to a set whose copies are still queued.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from atom_runtime.layers.forward_context import (
    AttentionMetadata,
    StateMetadata,
    set_attention_metadata,
    set_state_metadata,
)

if TYPE_CHECKING:
    from atom_runtime.protocol.worker import StepInputs

log = logging.getLogger(__name__)


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_num_seqs (capped at 512), as vLLM does."""
    top = min(max_num_seqs, 512)
    sizes = [s for s in (1, 2, 4) if s <= top] + list(range(8, top + 1, 8))
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


def capture_forward(model: nn.Module, ids, pos, pool, rows=None):
    """Warm the forward and LM head up twice (Triton compiles and autotunes outside the
    capture), then capture them into a graph of the memory pool `pool`: (graph, logits of
    `rows` (None: every row), fp32; the hidden states of every row)."""
    for _ in range(2):
        hidden = model(ids, pos)
        model.compute_logits(hidden if rows is None else hidden[rows]).float()
    torch.cuda.synchronize(ids.device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        hidden = model(ids, pos)
        logits = model.compute_logits(hidden if rows is None else hidden[rows]).float()
    return graph, logits, hidden


def step_buffers(tokens: int, seqs: int, max_blocks: int, device) -> dict[str, torch.Tensor]:
    """The device inputs every graph reads: ids, positions and cache slots (-1: none) of
    `tokens` rows, block tables `max_blocks` wide and lengths of `seqs` sequences."""
    return {
        "input_ids": torch.zeros(tokens, dtype=torch.int64, device=device),
        "positions": torch.zeros(tokens, dtype=torch.int64, device=device),
        "slot_mapping": torch.full((tokens,), -1, dtype=torch.int64, device=device),
        "block_tables": torch.zeros((seqs, max_blocks), dtype=torch.int32, device=device),
        "seq_lens": torch.zeros(seqs, dtype=torch.int32, device=device),
    }


def sliced_attention(bufs: dict, tokens: int, seqs: int, **more) -> AttentionMetadata:
    """Attention metadata over the first `tokens` rows and `seqs` sequences of a graph's
    buffers (`more`: the step kind's other fields)."""
    return AttentionMetadata(
        slot_mapping=bufs["slot_mapping"][:tokens],
        block_tables=bufs["block_tables"][:seqs],
        seq_lens=bufs["seq_lens"][:seqs],
        **more,
    )


def sliced_state(bufs: dict, starts: str, seqs: int, **more) -> StateMetadata:
    """State metadata over the first `seqs` sequences of a graph's buffers, their first
    tokens in `bufs[starts]`."""
    return StateMetadata(
        query_start_loc=bufs[starts][: seqs + 1],
        slot_ids=bufs["state_slots"][:seqs],
        has_initial_state=bufs["has_initial_state"][:seqs],
        **more,
    )


@contextlib.contextmanager
def step_metadata(attention: AttentionMetadata, state: StateMetadata | None = None):
    """The forward context a capture runs in (`state` for hybrid models), cleared after."""
    set_attention_metadata(attention)
    if state is not None:
        set_state_metadata(state)
    try:
        yield
    finally:
        set_attention_metadata(None)
        set_state_metadata(None)


class _CapturedGraphs:
    """What both kinds of captured graphs hold: the graphs with their output logits, the device
    input buffers they read, and two pinned host staging sets used in turn (with async
    scheduling step N+1 is staged while step N's copies may still be queued); an event per set
    says when the device has taken its copies, and a set is refilled only after it (the target's
    steps find it passed, their samples read back in between)."""

    def __init__(self) -> None:
        self.graphs: dict = {}
        # Each graph's hidden states (the model's output before the LM head), and the last
        # replay's (speculative decoding: an MTP head drafts from them).
        self.hidden: dict = {}
        self.last_hidden: torch.Tensor | None = None
        self.inputs: dict[str, torch.Tensor] = {}
        self._host_sets: list[dict[str, torch.Tensor]] = []
        self._staging_turn = 0
        self._staged: list[torch.cuda.Event | None] = [None, None]

    def __bool__(self) -> bool:
        return bool(self.graphs)

    def _capture_one(self, key, model, tokens: int, meta, state, pool, rows=None) -> None:
        """Capture graph `key`: the forward of the input buffers' first `tokens` rows in the
        context `meta` (and `state`), its logits of `rows` (None: every row)."""
        ids, pos = self.inputs["input_ids"][:tokens], self.inputs["positions"][:tokens]
        with step_metadata(meta, state):
            graph, logits, self.hidden[key] = capture_forward(model, ids, pos, pool, rows)
        self.graphs[key] = (graph, logits)

    def _next_host_set(self) -> dict[str, torch.Tensor]:
        """The staging set to fill, once the device has taken what it held before: a drafter's
        chain of steps replays without reading anything back in between, so the GPU may not
        have run the copies of two replays ago yet."""
        turn = self._staging_turn
        if self._staged[turn] is not None:
            self._staged[turn].synchronize()
        self._staging_turn ^= 1
        return self._host_sets[turn]

    def _mark_staged(self) -> None:
        """After a replay's copies are queued: the set they read is free once this passes
        (one event a set, recorded again at each use)."""
        turn = self._staging_turn ^ 1
        if self._staged[turn] is None:
            self._staged[turn] = torch.cuda.Event()
        self._staged[turn].record()

    def clear(self) -> None:
        """Drop the graphs and their buffers, so their memory can be freed."""
        self.graphs.clear()
        self.hidden.clear()
        self.last_hidden = None
        self.inputs = {}
        self._host_sets = []
        self._staged = [None, None]


class DecodeGraphs(_CapturedGraphs):
    """The captured decode graphs of one model, their device input buffers and host staging."""

    def __init__(self) -> None:
        super().__init__()
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.sizes: list[int] = []
        self._table_stages: dict[str, torch.Tensor] = {}
        self.stateful = False
        self.windowed = False

    def capture(
        self,
        model: nn.Module,
        device: torch.device,
        sizes: list[int],
        max_blocks: int,
        stateful: bool = False,
        windowed: bool = False,
    ) -> None:
        """Capture one graph per batch size in `sizes` (sorted ascending) over block tables
        `max_blocks` wide. `stateful` (hybrid models): state slot ids and has_initial_state are
        graph inputs too. `windowed` (KV groups): so are the window layers' slot mapping and
        block tables."""
        self.stateful = stateful
        self.windowed = windowed
        max_bs = sizes[-1]
        dev = device
        bufs = step_buffers(max_bs, max_bs, max_blocks, dev)
        # One token per row, so the state's token offsets are fixed; padded rows use slot -1
        # (no slot read or written).
        bufs["state_slots"] = torch.full((max_bs,), -1, dtype=torch.int32, device=dev)
        bufs["has_initial_state"] = torch.zeros(max_bs, dtype=torch.bool, device=dev)
        bufs["query_start_loc"] = torch.arange(max_bs + 1, dtype=torch.int32, device=dev)
        if windowed:
            bufs["window_slot_mapping"] = torch.full((max_bs,), -1, dtype=torch.int64, device=dev)
            bufs["window_block_tables"] = torch.zeros_like(bufs["block_tables"])
        self.inputs = bufs
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for bs in reversed(sizes):
                meta = sliced_attention(bufs, bs, bs, decode_only=True)
                if windowed:
                    meta.window = AttentionMetadata(
                        slot_mapping=bufs["window_slot_mapping"][:bs],
                        block_tables=bufs["window_block_tables"][:bs],
                        seq_lens=meta.seq_lens,
                        decode_only=True,
                    )
                state = sliced_state(bufs, "query_start_loc", bs) if stateful else None
                self._capture_one(bs, model, bs, meta, state, pool)
        torch.cuda.synchronize(dev)
        self.sizes = sizes
        self._make_staging(bufs, windowed, max_bs * max_blocks, dev)
        log.info("captured CUDA graphs for decode batch sizes %s", sizes)

    def _make_staging(self, bufs: dict, windowed: bool, table_size: int, dev) -> None:
        """Pinned host staging: a decode step fills one set and copies it over asynchronously.
        Block tables go flat (a step's n x width, packed), through a device stage."""
        tables = ["block_tables", "window_block_tables"] if windowed else ["block_tables"]
        self._host_sets = []
        for _ in range(2):
            host = {
                name: torch.empty(buf.shape, dtype=buf.dtype).pin_memory()
                for name, buf in bufs.items()
                if name not in tables and name != "query_start_loc"
            }
            for name in tables:
                host[name] = torch.zeros(table_size, dtype=torch.int32).pin_memory()
            self._host_sets.append(host)
        self._staging_turn = 0
        self._table_stages = {
            name: torch.zeros(table_size, dtype=torch.int32, device=dev) for name in tables
        }

    def replay(
        self,
        inputs: StepInputs,
        fill_pending: Callable[[torch.Tensor, np.ndarray], None] | None,
        device_ids: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Logits of every row of a decode-only batch through a captured graph (padded to the
        next captured size), or None when the batch is larger than every graph. `fill_pending`
        copies the tokens still on the device into the input ids buffer (async scheduling);
        `device_ids`, when given, are the rows' ids already on the device (a drafter's chained
        drafts), taken over the staged ones."""
        n = len(inputs.input_ids)
        bs = next((s for s in self.sizes if s >= n), None) if self.graphs else None
        if bs is None:
            return None
        host, dev = self._next_host_set(), self.inputs
        ids = host["input_ids"].numpy()
        ids[:n] = inputs.input_ids
        ids[n:bs] = 0  # padded rows: any valid id (never a pending placeholder left over)
        positions = host["positions"].numpy()
        positions[:n] = inputs.positions
        positions[n:bs] = 0
        slots = host["slot_mapping"].numpy()
        slots[:n] = inputs.slot_mapping
        slots[n:bs] = -1
        names = ["input_ids", "positions", "slot_mapping", "seq_lens"]
        if self.windowed:
            if inputs.window_slot_mapping is None:
                raise RuntimeError("a windowed model's decode step came without window tables")
            window_slots = host["window_slot_mapping"].numpy()
            window_slots[:n] = inputs.window_slot_mapping
            window_slots[n:bs] = -1
            names.append("window_slot_mapping")
        lens = host["seq_lens"].numpy()
        lens[:n] = inputs.seq_lens
        lens[n:bs] = 0  # padded rows attend to nothing
        if self.stateful:
            if inputs.state_slots is None:
                raise RuntimeError("a hybrid model's decode step came without state slots")
            state_slots = host["state_slots"].numpy()
            state_slots[:n] = inputs.state_slots
            state_slots[n:bs] = -1  # padded rows touch no slot
            has_state = host["has_initial_state"].numpy()
            has_state[:n] = inputs.has_initial_state
            has_state[n:bs] = False
            names += ["state_slots", "has_initial_state"]
        for name in names:
            dev[name][:bs].copy_(host[name][:bs], non_blocking=True)
        self._copy_table(host, "block_tables", inputs.block_tables)
        if self.windowed:
            self._copy_table(host, "window_block_tables", inputs.window_block_tables)
        if inputs.pending_sources is not None:
            fill_pending(dev["input_ids"], inputs.pending_sources)
        if device_ids is not None:
            dev["input_ids"][:n].copy_(device_ids)
        self._mark_staged()
        graph, logits = self.graphs[bs]
        graph.replay()
        self.last_hidden = self.hidden[bs][:n]
        return logits[:n]

    def _copy_table(self, host: dict[str, torch.Tensor], name: str, table: np.ndarray) -> None:
        """A step's [n, width] block table into the graphs' [max_bs, max_blocks] buffer: packed
        into pinned memory, one asynchronous copy to the device stage, one copy into place."""
        n, width = table.shape
        packed = n * width
        host[name].numpy()[:packed] = table.reshape(-1)
        stage = self._table_stages[name][:packed]
        stage.copy_(host[name][:packed], non_blocking=True)
        self.inputs[name][:n, :width].copy_(stage.view(n, width))

    def clear(self) -> None:
        super().clear()
        self._table_stages = {}


def default_prefill_buckets(max_tokens: int, max_num_seqs: int) -> list[tuple[int, int]]:
    """(tokens, sequences) pairs to capture for short prefill and mixed steps: tokens 16, 32,
    ... up to max_tokens (max_tokens itself the last), sequences 1, 2, 4, 8 (at most
    max_num_seqs), every pair with no more sequences than tokens."""
    if max_tokens < 1:
        return []
    tokens = [t for t in (16, 32, 64, 128, 256, 512, 1024, 2048) if t < max_tokens]
    tokens.append(max_tokens)
    seqs = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    return [(t, s) for t in tokens for s in seqs if s <= t]


class PrefillGraphs(_CapturedGraphs):
    """Captured forwards for steps that are not decode-only but short: a few new tokens over a
    cached prefix (W3), a short prompt, a prompt chunk beside a few decodes. Eagerly, such a
    step costs a Python launch per kernel (≈ 400 for a 28-layer model), far more than its GPU
    time; replayed, it costs its GPU time.

    One graph per (tokens, sequences) bucket. A step of t tokens in s sequences replays the
    smallest bucket holding both, padded: padding tokens have slot -1 (no cache write) and
    belong to no sequence, padding sequences have no query tokens and a length of 0 (the
    prefill kernel and its split merge skip both). The attention launch is planned from the
    bucket's shapes (`max_seqlen_q` the bucket's tokens, the block table's full width), so the
    captured plan holds for any chunk that fits. A graph computes the logits of as many sample
    rows as its bucket has sequences: a step with more sample rows than sequences (prompt
    logprobs) takes a bucket with room for them, or runs eagerly when none has."""

    def __init__(self) -> None:
        super().__init__()
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.buckets: list[tuple[int, int]] = []
        self._max_blocks = 0
        self.replays = 0  # steps served by a graph (the tests read it)

    def capture(
        self,
        model: nn.Module,
        device: torch.device,
        buckets: list[tuple[int, int]],
        max_blocks: int,
    ) -> None:
        """Capture one graph per (tokens, sequences) bucket over block tables `max_blocks`
        wide, in a memory pool of their own."""
        if not buckets:
            return
        buckets = sorted(set(buckets))
        max_t = max(t for t, _ in buckets)
        max_s = max(s for _, s in buckets)
        dev = device
        bufs = step_buffers(max_t, max_s, max_blocks, dev)
        bufs["cu_seqlens_q"] = torch.zeros(max_s + 1, dtype=torch.int32, device=dev)
        bufs["sample_rows"] = torch.zeros(max_s, dtype=torch.int64, device=dev)
        self.inputs = bufs
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            # Largest first, so the smaller graphs reuse the pool's blocks.
            for t, s in sorted(buckets, reverse=True):
                # Warm-up and capture inputs: each sequence one token, the rest padding.
                bufs["cu_seqlens_q"][: s + 1] = torch.arange(s + 1, dtype=torch.int32)
                bufs["seq_lens"][:s] = 1
                meta = sliced_attention(
                    bufs, t, s, decode_only=False, cu_seqlens_q=bufs["cu_seqlens_q"][: s + 1],
                    max_seqlen_q=t,
                )  # fmt: skip
                self._capture_one((t, s), model, t, meta, None, pool, bufs["sample_rows"][:s])
        torch.cuda.synchronize(dev)
        bufs["seq_lens"].zero_()
        bufs["cu_seqlens_q"].zero_()
        self.buckets = buckets
        self._max_blocks = max_blocks
        self._host_sets = [
            {name: torch.empty_like(buf, device="cpu").pin_memory() for name, buf in bufs.items()}
            for _ in range(2)
        ]
        self._staging_turn = 0
        log.info(
            "captured CUDA graphs for prefill and mixed steps of up to %d tokens in up to %d "
            "sequences (%d graphs)", max_t, max_s, len(buckets),
        )  # fmt: skip

    def bucket_for(
        self, tokens: int, seqs: int, samples: int, width: int
    ) -> tuple[int, int] | None:
        """The smallest captured bucket that a step of these sizes fits, or None."""
        if width > self._max_blocks:
            return None
        need_s = max(seqs, samples)
        for t, s in self.buckets:  # sorted: tokens first, then sequences
            if t >= tokens and s >= need_s:
                return t, s
        return None

    def replay(
        self,
        inputs: StepInputs,
        fill_pending: Callable[[torch.Tensor, np.ndarray], None],
    ) -> torch.Tensor | None:
        """Logits of the sample rows of a short prefill or mixed step through a captured graph,
        or None when no bucket fits it (the caller runs it eagerly). Rows: `sample_rows`'s
        order; an empty [0, vocab] tensor when no row samples."""
        if not self.graphs or inputs.cu_seqlens_q is None:
            return None
        t = len(inputs.input_ids)
        s = len(inputs.seq_lens)
        k = len(inputs.sample_rows)
        width = inputs.block_tables.shape[1]
        bucket = self.bucket_for(t, s, k, width)
        if bucket is None:
            return None
        bt, bs = bucket
        host, dev = self._next_host_set(), self.inputs
        h = {name: buf.numpy() for name, buf in host.items()}
        h["input_ids"][:t] = inputs.input_ids
        h["input_ids"][t:bt] = 0
        h["positions"][:t] = inputs.positions
        h["positions"][t:bt] = 0
        h["slot_mapping"][:t] = inputs.slot_mapping
        h["slot_mapping"][t:bt] = -1  # padding tokens write no cache slot
        h["seq_lens"][:s] = inputs.seq_lens
        h["seq_lens"][s:bs] = 0  # padding sequences attend to nothing
        h["cu_seqlens_q"][: s + 1] = inputs.cu_seqlens_q
        h["cu_seqlens_q"][s + 1 : bs + 1] = t  # no query tokens
        h["sample_rows"][:k] = inputs.sample_rows
        h["sample_rows"][k:bs] = 0
        h["block_tables"][:s, :width] = inputs.block_tables
        for name, n in (
            ("input_ids", bt), ("positions", bt), ("slot_mapping", bt), ("seq_lens", bs),
            ("cu_seqlens_q", bs + 1), ("sample_rows", bs), ("block_tables", s),
        ):  # fmt: skip
            dev[name][:n].copy_(host[name][:n], non_blocking=True)
        if inputs.pending_sources is not None:
            fill_pending(dev["input_ids"], inputs.pending_sources)
        self._mark_staged()
        graph, logits = self.graphs[bucket]
        graph.replay()
        self.replays += 1
        self.last_hidden = self.hidden[bucket][:t]
        return logits[:k]

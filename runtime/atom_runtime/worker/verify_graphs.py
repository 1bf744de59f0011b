"""CUDA graphs for speculative verify steps: B sequences of exactly k + 1 rows each, one graph
per batch size, logits of every row (and the hidden states, which an MTP head drafts from).

A verify step qualifies when every sequence runs its last token with at most k drafts (a plain
decode row included) and samples every row (no prompt chunk, no prompt logprobs). A sequence
with n < k drafts is padded to k + 1 rows: the padding rows write no cache slot (slot -1), keep
no recurrent state (their per-token state slots are -1), sit at the sequence's last real
position for rotary, and attend after the real rows, so no real row sees them (the sequence
length is lengthened by the padding, as if the drafts were there; the key slots past the real
ones are read only by padding rows). Their logits are dropped on the way out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from atom_runtime.worker.cuda_graphs import (
    _CapturedGraphs,
    sliced_attention,
    sliced_state,
    step_buffers,
)

if TYPE_CHECKING:
    from atom_runtime.protocol.worker import StepInputs

log = logging.getLogger(__name__)


class VerifyGraphs(_CapturedGraphs):
    def __init__(self) -> None:
        super().__init__()
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.sizes: list[int] = []
        self.rows = 0
        self.stateful = False
        self._max_blocks = 0
        self.replays = 0  # steps served by a graph (the tests read it)

    def capture(
        self, model: nn.Module, device: torch.device, sizes: list[int], max_blocks: int,
        rows: int, stateful: bool = False,
    ) -> None:  # fmt: skip
        """One graph per batch size in `sizes` (ascending) of `rows` tokens a sequence, over
        block tables `max_blocks` wide (wide enough for a padded sequence's reach past its
        real tokens: the caller adds the blocks `rows` tokens can span)."""
        max_b = sizes[-1]
        t = max_b * rows
        dev = device
        bufs = step_buffers(t, max_b, max_blocks, dev)
        bufs["cu_seqlens_q"] = torch.arange(max_b + 1, dtype=torch.int32, device=dev) * rows
        bufs["state_slots"] = torch.full((max_b,), -1, dtype=torch.int32, device=dev)
        bufs["has_initial_state"] = torch.zeros(max_b, dtype=torch.bool, device=dev)
        bufs["spec_slots"] = torch.full((max_b, rows), -1, dtype=torch.int32, device=dev)
        self.inputs = bufs
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for b in reversed(sizes):
                n = b * rows
                meta = sliced_attention(
                    bufs, n, b, decode_only=False, cu_seqlens_q=bufs["cu_seqlens_q"][: b + 1],
                    max_seqlen_q=rows,
                )  # fmt: skip
                state = None
                if stateful:
                    state = sliced_state(
                        bufs, "cu_seqlens_q", b, spec_slots=bufs["spec_slots"][:b], spec_only=True
                    )
                self._capture_one(b, model, n, meta, state, pool)
        torch.cuda.synchronize(dev)
        self.sizes, self.rows, self.stateful, self._max_blocks = sizes, rows, stateful, max_blocks
        self._host_sets = [
            {name: torch.empty_like(buf, device="cpu").pin_memory() for name, buf in bufs.items()}
            for _ in range(2)
        ]
        log.info("captured CUDA graphs for verify steps of %d rows a sequence, batch sizes %s",
                 rows, sizes)  # fmt: skip

    def replay(
        self, inputs: StepInputs, before: Callable[[torch.Tensor], None] | None = None
    ) -> torch.Tensor | None:
        """Logits of every row of a qualifying verify step (rows in the step's order), through
        the smallest graph of enough sequences; None when the step does not qualify. `before`
        gets the padded row of each real token (on the device) ahead of the replay: a drafting
        MTP head fills its hidden-state input there."""
        plan = self._plan(inputs)
        if plan is None:
            return None
        b, real = plan
        host, dev = self._next_host_set(), self.inputs
        h = {name: buf.numpy() for name, buf in host.items()}
        self._fill(h, inputs, b, real)
        n = b * self.rows
        names = [("input_ids", n), ("positions", n), ("slot_mapping", n), ("seq_lens", b),
                 ("block_tables", b)]  # fmt: skip
        if self.stateful:
            names += [("has_initial_state", b), ("spec_slots", b)]
        for name, count in names:
            dev[name][:count].copy_(host[name][:count], non_blocking=True)
        graph, logits = self.graphs[b]
        index = torch.from_numpy(real).pin_memory().to(logits.device, non_blocking=True)
        self._mark_staged()
        if before is not None:
            before(index)
        graph.replay()
        self.replays += 1
        self.last_hidden = self.hidden[b].index_select(0, index)
        return logits.index_select(0, index)

    def _plan(self, inputs: StepInputs) -> tuple[int, np.ndarray] | None:
        """(graph batch size, padded row of each real token) for a qualifying step."""
        if not self.graphs or inputs.cu_seqlens_q is None or inputs.pending_sources is not None:
            return None
        q = np.diff(inputs.cu_seqlens_q)
        s = len(q)
        tokens = int(inputs.cu_seqlens_q[-1])
        if (
            q.max() > self.rows
            or len(inputs.sample_rows) != tokens
            or inputs.block_tables.shape[1] > self._max_blocks
            or (self.stateful and inputs.spec_slots is None)
        ):
            return None
        b = next((size for size in self.sizes if size >= s), None)
        if b is None:
            return None
        # Every row samples, in token order.
        if not np.array_equal(inputs.sample_rows, np.arange(tokens)):
            return None
        within = np.arange(tokens) - np.repeat(inputs.cu_seqlens_q[:-1], q)
        real = np.repeat(np.arange(s) * self.rows, q) + within
        return b, real.astype(np.int64)

    def _fill(self, h: dict, inputs: StepInputs, b: int, real: np.ndarray) -> None:
        rows, s = self.rows, len(inputs.seq_lens)
        n = b * rows
        q = np.diff(inputs.cu_seqlens_q)
        last = inputs.positions[inputs.cu_seqlens_q[1:] - 1]
        h["input_ids"][:n] = 0
        h["positions"][:n] = np.repeat(np.concatenate([last, np.zeros(b - s, np.int64)]), rows)
        h["slot_mapping"][:n] = -1
        h["input_ids"][real] = inputs.input_ids
        h["positions"][real] = inputs.positions
        h["slot_mapping"][real] = inputs.slot_mapping
        h["seq_lens"][:s] = inputs.seq_lens + (rows - q)
        h["seq_lens"][s:b] = 0  # padding sequences attend to nothing
        width = inputs.block_tables.shape[1]
        h["block_tables"][:s] = 0
        h["block_tables"][:s, :width] = inputs.block_tables
        if self.stateful:
            h["has_initial_state"][:s] = inputs.has_initial_state
            h["has_initial_state"][s:b] = False
            h["spec_slots"][:b] = -1
            h["spec_slots"][:s, : inputs.spec_slots.shape[1]] = inputs.spec_slots

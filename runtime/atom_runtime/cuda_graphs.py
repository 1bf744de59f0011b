"""CUDA graphs for decode steps: one captured forward (model and logits) per batch size.

A decode-only step of n sequences replays the smallest graph of at least n rows, its rows past n
padded (attending to nothing, writing no cache slot). The graphs read their inputs from fixed
device buffers; a step fills one of two pinned host staging sets and copies it into them
asynchronously, so the host never waits for the device to take an input.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from atom_runtime.forward_context import (
    AttentionMetadata,
    StateMetadata,
    set_attention_metadata,
    set_state_metadata,
)

if TYPE_CHECKING:
    from atom_runtime.engine.protocol import StepInputs

log = logging.getLogger(__name__)


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_num_seqs (capped at 512), as vLLM does."""
    top = min(max_num_seqs, 512)
    sizes = [s for s in (1, 2, 4) if s <= top] + list(range(8, top + 1, 8))
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


class DecodeGraphs:
    """The captured decode graphs of one model, their device input buffers and host staging."""

    def __init__(self) -> None:
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.sizes: list[int] = []
        self.inputs: dict[str, torch.Tensor] = {}
        self._host_sets: list[dict[str, torch.Tensor]] = []
        self._staging_turn = 0
        self._block_table_stage: torch.Tensor | None = None
        self.stateful = False

    def __bool__(self) -> bool:
        return bool(self.graphs)

    def capture(
        self,
        model: nn.Module,
        device: torch.device,
        sizes: list[int],
        max_blocks: int,
        stateful: bool = False,
    ) -> None:
        """Capture one graph per batch size in `sizes` (sorted ascending) over block tables
        `max_blocks` wide. `stateful` (hybrid models): state slot ids and has_initial_state are
        graph inputs too."""
        self.stateful = stateful
        max_bs = sizes[-1]
        dev = device
        bufs = {
            "input_ids": torch.zeros(max_bs, dtype=torch.int64, device=dev),
            "positions": torch.zeros(max_bs, dtype=torch.int64, device=dev),
            "slot_mapping": torch.full((max_bs,), -1, dtype=torch.int64, device=dev),
            "block_tables": torch.zeros((max_bs, max_blocks), dtype=torch.int32, device=dev),
            "seq_lens": torch.zeros(max_bs, dtype=torch.int32, device=dev),
            # One token per row, so the state's token offsets are fixed; padded rows use slot
            # -1 (no slot read or written).
            "state_slots": torch.full((max_bs,), -1, dtype=torch.int32, device=dev),
            "has_initial_state": torch.zeros(max_bs, dtype=torch.bool, device=dev),
            "query_start_loc": torch.arange(max_bs + 1, dtype=torch.int32, device=dev),
        }
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for bs in reversed(sizes):
                meta = AttentionMetadata(
                    slot_mapping=bufs["slot_mapping"][:bs],
                    block_tables=bufs["block_tables"][:bs],
                    seq_lens=bufs["seq_lens"][:bs],
                    decode_only=True,
                )
                set_attention_metadata(meta)
                if stateful:
                    set_state_metadata(
                        StateMetadata(
                            query_start_loc=bufs["query_start_loc"][: bs + 1],
                            slot_ids=bufs["state_slots"][:bs],
                            has_initial_state=bufs["has_initial_state"][:bs],
                        )
                    )
                ids, pos = bufs["input_ids"][:bs], bufs["positions"][:bs]
                for _ in range(2):  # warm up: Triton compiles and autotunes outside capture
                    model.compute_logits(model(ids, pos)).float()
                torch.cuda.synchronize(dev)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = model.compute_logits(model(ids, pos)).float()
                self.graphs[bs] = (graph, logits)
                set_attention_metadata(None)
                set_state_metadata(None)
        torch.cuda.synchronize(dev)
        self.inputs = bufs
        self.sizes = sizes
        # Pinned host staging: a decode step fills one set and copies it over asynchronously.
        # Two sets, alternating: with async scheduling step N+1 is staged while step N's copies
        # may still be queued; step N-1's (same set) are done, its samples were read back.
        self._host_sets = [
            {
                "input_ids": torch.zeros(max_bs, dtype=torch.int64).pin_memory(),
                "positions": torch.zeros(max_bs, dtype=torch.int64).pin_memory(),
                "slot_mapping": torch.full((max_bs,), -1, dtype=torch.int64).pin_memory(),
                "seq_lens": torch.zeros(max_bs, dtype=torch.int32).pin_memory(),
                "state_slots": torch.full((max_bs,), -1, dtype=torch.int32).pin_memory(),
                "has_initial_state": torch.zeros(max_bs, dtype=torch.bool).pin_memory(),
                "block_tables": torch.zeros(max_bs * max_blocks, dtype=torch.int32).pin_memory(),
            }
            for _ in range(2)
        ]
        self._staging_turn = 0
        self._block_table_stage = torch.zeros(max_bs * max_blocks, dtype=torch.int32, device=dev)
        log.info("captured CUDA graphs for decode batch sizes %s", sizes)

    def replay(
        self,
        inputs: StepInputs,
        fill_pending: Callable[[torch.Tensor, np.ndarray], None],
    ) -> torch.Tensor | None:
        """Logits of every row of a decode-only batch through a captured graph (padded to the
        next captured size), or None when the batch is larger than every graph. `fill_pending`
        copies the tokens still on the device into the input ids buffer (async scheduling)."""
        n = len(inputs.input_ids)
        bs = next((s for s in self.sizes if s >= n), None) if self.graphs else None
        if bs is None:
            return None
        host, dev = self._host_sets[self._staging_turn], self.inputs
        self._staging_turn ^= 1
        ids = host["input_ids"].numpy()
        ids[:n] = inputs.input_ids
        ids[n:bs] = 0  # padded rows: any valid id (never a pending placeholder left over)
        positions = host["positions"].numpy()
        positions[:n] = inputs.positions
        positions[n:bs] = 0
        slots = host["slot_mapping"].numpy()
        slots[:n] = inputs.slot_mapping
        slots[n:bs] = -1
        lens = host["seq_lens"].numpy()
        lens[:n] = inputs.seq_lens
        lens[n:bs] = 0  # padded rows attend to nothing
        names = ["input_ids", "positions", "slot_mapping", "seq_lens"]
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
        width = inputs.block_tables.shape[1]
        packed = n * width
        host["block_tables"].numpy()[:packed] = inputs.block_tables.reshape(-1)
        stage = self._block_table_stage[:packed]
        stage.copy_(host["block_tables"][:packed], non_blocking=True)
        dev["block_tables"][:n, :width].copy_(stage.view(n, width))
        if inputs.pending_sources is not None:
            fill_pending(dev["input_ids"], inputs.pending_sources)
        graph, logits = self.graphs[bs]
        graph.replay()
        return logits[:n]

    def clear(self) -> None:
        """Drop the graphs and their buffers, so their memory can be freed."""
        self.graphs.clear()
        self.inputs = {}
        self._host_sets = []
        self._block_table_stage = None

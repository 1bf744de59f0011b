"""CUDA graphs of a drafting model (speculative decoding with a draft model or an MTP head).

After every step the drafter catches its KV up on the positions the target just computed (at
most `catch_up_rows` a sequence after a verify step), then drafts tokens 2..k one row each.
Eagerly each of those forwards costs a Python launch a kernel (a 16-layer draft model: ~8 ms
a catch-up on the H200 against ~1 ms of GPU time). Captured: the catch-up as a verify-shaped
step (VerifyGraphs: `catch_up_rows` rows a sequence, padded), the drafts as decode steps
(DecodeGraphs), one set per module the drafts run (an MTP head with several layers uses them in
turn). The drafter picks a graph when one fits and runs eagerly otherwise (a prompt chunk's
catch-up).
"""

from __future__ import annotations

import logging

import torch

from atom_runtime.worker.cuda_graphs import DecodeGraphs
from atom_runtime.worker.verify_graphs import VerifyGraphs

log = logging.getLogger(__name__)


class DrafterGraphs:
    def __init__(self) -> None:
        self.catch_up = VerifyGraphs()
        self.drafts: dict[int, DecodeGraphs] = {}

    def __bool__(self) -> bool:
        return bool(self.catch_up) or bool(self.drafts)

    def capture(self, drafter, device: torch.device, sizes: list[int], max_blocks: int) -> None:
        """Capture `drafter`'s catch-up and draft steps for batch sizes `sizes` (ascending) over
        block tables `max_blocks` wide (wide enough for a padded catch-up's reach)."""
        rows = drafter.catch_up_rows
        max_rows = sizes[-1] * rows  # the MTP head's hidden-state buffer, allocated first
        self.catch_up.capture(drafter.graph_model(0, max_rows), device, sizes, max_blocks, rows)
        for layer in sorted(drafter.draft_layers()):
            graphs = DecodeGraphs()
            graphs.capture(drafter.graph_model(layer, max_rows), device, sizes, max_blocks)
            self.drafts[layer] = graphs
        log.info(
            "captured the drafter's CUDA graphs: catch-up of %d rows a sequence, %d draft step "
            "module(s), batch sizes %s", rows, len(self.drafts), sizes,
        )  # fmt: skip

    def clear(self) -> None:
        self.catch_up.clear()
        for graphs in self.drafts.values():
            graphs.clear()
        self.drafts.clear()

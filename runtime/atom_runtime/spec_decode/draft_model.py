"""`draft_model`: a smaller model of the target's tokenizer proposes, with a KV cache of its own
(allocated beside the target's, indexed by the same block ids). Dense (Llama-family) drafts
only: a hybrid draft would need state slots of its own."""

from __future__ import annotations

import logging

import torch

from atom_runtime.models.loader import build_model, load_model_config, resolve_model_path
from atom_runtime.spec_decode.config import check_draft_fits
from atom_runtime.spec_decode.model_drafter import ModelDrafter

log = logging.getLogger(__name__)


class DraftModelDrafter(ModelDrafter):
    def __init__(self, spec, config, target_config, dtype: torch.dtype, target) -> None:
        device = next(target.parameters()).device
        path = resolve_model_path(spec.model, None, config.download_dir)
        draft_config = load_model_config(path)
        check_draft_fits(
            target_config.vocab_size,
            draft_config.vocab_size,
            draft_config.model_type,
            draft_config.is_hybrid,
        )
        # Dummy targets (benchmarks) get a dummy draft; real ones read the draft's own files.
        load_format = "dummy" if config.load_format == "dummy" else "auto"
        self.model = build_model(path, draft_config, load_format, dtype, device, config.seed + 1)
        self.config = draft_config
        limit = min(draft_config.max_position_embeddings, target_config.max_position_embeddings)
        super().__init__(spec.num_speculative_tokens, device, config.block_size, limit)
        log.info(
            "draft model %s: %d layers, %.1fM parameters, k = %d",
            path,
            draft_config.num_hidden_layers,
            sum(p.numel() for p in self.model.parameters()) / 1e6,
            self.k,
        )

    def attention_layers(self) -> list:
        return self.model.attention_layers()

    def graph_model(self, layer: int, max_rows: int) -> torch.nn.Module:
        return self.model

    def _forward(self, ids, positions, hidden, step: int = 0):
        return self.model(ids, positions)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden).float()

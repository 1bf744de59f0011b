"""The attention metadata of the step being run, set by the model runner around each forward.

Layers read it instead of threading it through every module signature; CUDA-graph replay works
because the runner fills the same tensors in place before each replay.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [T]: cache slot of each new token (-1: padding)
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    seq_lens: torch.Tensor  # int32 [B]: tokens in cache per sequence, this step's included
    decode_only: bool  # every sequence runs exactly one new token
    cu_seqlens_q: torch.Tensor | None = None  # int32 [B+1], for mixed/prefill batches
    max_seqlen_q: int = 1
    # Host chunk lengths when every chunk starts at position 0 (fresh prompts: attention over
    # the step's own K/V only, `fresh_chunk_lengths`); None otherwise, and in captured graphs.
    fresh_chunks: tuple[int, ...] | None = None
    # Rows the qkv projection allocates for its output, zeros past the step's tokens, when the
    # step's lone fresh chunk attends densely (its length bucket,
    # `varlen_attention.bucket_length`): the attention then pads it without a copy. 0: none.
    dense_rows: int = 0
    # Host copies of cu_seqlens_q, seq_lens and the block tables on eager non-decode steps
    # (None on decode steps and in captured graphs): layers that plan a step on the host read
    # them (MLA's prefill path: which chunks up-project, the context rows they gather).
    host_cu_seqlens_q: np.ndarray | None = None
    host_seq_lens: np.ndarray | None = None
    host_block_tables: np.ndarray | None = None
    # What a layer kind derives from this metadata once a forward and every layer of that kind
    # reuses (MLA's per-token attention rows), keyed by the layer kind's name; the model clears
    # it at the start of each forward (a captured graph must record the derivation).
    derived: dict = field(default_factory=dict)
    # Sliding-window layers whose blocks the engine keeps apart (KV groups, docs/models.md):
    # their own slot mapping and block tables, the rest of the step as above. None: every
    # layer reads and writes through the tables above.
    window: AttentionMetadata | None = None


def fresh_chunk_lengths(cu_seqlens_q: np.ndarray, seq_lens: np.ndarray) -> tuple[int, ...] | None:
    """Each chunk's length when every chunk of a step starts at position 0, i.e. each sequence
    holds nothing but its chunk (`seq_lens` equals the chunk lengths); else None. A decode row
    or a chunk over a cached prefix or an earlier chunk makes it None. Host arrays only, so
    deciding costs no device sync."""
    chunks = np.diff(cu_seqlens_q)
    if len(chunks) == 0 or not np.array_equal(chunks, seq_lens):
        return None
    return tuple(chunks.tolist())


_current: AttentionMetadata | None = None


def set_attention_metadata(meta: AttentionMetadata | None) -> None:
    global _current
    _current = meta


def dense_rows() -> int:
    """The running step's `AttentionMetadata.dense_rows` (0 outside a step)."""
    return 0 if _current is None else _current.dense_rows


def get_attention_metadata() -> AttentionMetadata:
    if _current is None:
        raise RuntimeError("no attention metadata: forward called outside the model runner")
    return _current


@dataclass
class StateMetadata:
    """Per-sequence state addressing for hybrid models' recurrent layers (one row per sequence
    of the step, in batch order)."""

    query_start_loc: torch.Tensor  # int32 [B+1]: token offsets of each sequence's new tokens
    slot_ids: torch.Tensor  # int32 [B]: each sequence's committed state slot (-1: padding row)
    has_initial_state: torch.Tensor  # bool [B]: False starts from zero state (a fresh prefill)
    # A speculative verify step: int32 [B, 1 + k], the slots a verified row reads (column 0)
    # and leaves the state after each of its tokens in (`ops.gated_delta_rule_verify_`); -1
    # rows are the step's prompt chunks, which run through the plain ops on `slot_ids` (-1 for
    # the verified rows). `spec_only`: every row is verified (the plain ops are skipped).
    spec_slots: torch.Tensor | None = None
    spec_only: bool = False


_state: StateMetadata | None = None


def set_state_metadata(meta: StateMetadata | None) -> None:
    global _state
    _state = meta


def padding_state_metadata(rows: int, tokens: int, device: torch.device) -> StateMetadata:
    """State metadata for a warm-up, profiling or timing forward: every row a padding row
    (slot -1), so no slot is read or written. `tokens` are split evenly over the rows."""
    per_row = tokens // rows
    qsl = torch.arange(rows + 1, dtype=torch.int32, device=device) * per_row
    qsl[-1] = tokens
    return StateMetadata(
        query_start_loc=qsl,
        slot_ids=torch.full((rows,), -1, dtype=torch.int32, device=device),
        has_initial_state=torch.zeros(rows, dtype=torch.bool, device=device),
    )


def get_state_metadata() -> StateMetadata:
    if _state is None:
        raise RuntimeError("no state metadata: a hybrid model's forward runs inside the runner")
    return _state

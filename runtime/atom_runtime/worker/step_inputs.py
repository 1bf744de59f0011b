"""The model runner's input side: a scheduled batch as host arrays (`StepInputs`, the same on every
tensor-parallel rank), the decode fast path, the rows whose token the previous step sampled on
the device (async scheduling), and the prompt_logprobs rows taken out of a step's logits."""

from __future__ import annotations

import numpy as np
import torch

from atom_runtime.core.batch import ScheduledBatch
from atom_runtime.core.sequence import PENDING_TOKEN, Sequence
from atom_runtime.layers.forward_context import (
    AttentionMetadata,
    StateMetadata,
    fresh_chunk_lengths,
)
from atom_runtime.protocol.worker import StepInputs
from atom_runtime.spec_decode.proposer import StepChunk
from atom_runtime.system.device import to_device, to_device_many


class StepInputPreparation:
    """ModelRunner's part that builds each step's inputs (a mixin: it reads the runner's block
    size, state tensors and the last step's samples)."""

    def _new_step_chunks(self) -> dict[int, StepChunk] | None:
        """A fresh record of where each sequence's tokens sit in this step, for a drafter that
        reads it (speculative decoding); None otherwise."""
        drafter = self.drafter
        self._step_chunks = {} if drafter is not None and drafter.needs_step_chunks else None
        return self._step_chunks

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
        chunks = self._new_step_chunks()
        tables = np.zeros((len(batch.seqs), max_blocks), dtype=np.int32)
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
            start = seq.num_computed_tokens
            end = start + n
            ids_parts.append(np.frombuffer(seq.token_ids, dtype=np.int32)[start:end])
            if chunks is not None:
                chunks[id(seq)] = StepChunk(start, offset)
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
                # (and a verify row samples at its last token and at each of its drafts)
                rows = range(offset - 1 - seq.num_spec, offset)
                sampler_pos.extend(range(len(sample_rows), len(sample_rows) + len(rows)))
                sample_rows.extend(rows)
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
        if self.model_config.kv_window is not None:
            self._add_window_rows(inputs, batch.seqs)
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
        chunks = self._new_step_chunks()
        if chunks is not None:
            chunks.update(
                (id(s), StepChunk(p, i)) for i, (s, p) in enumerate(zip(seqs, pos, strict=True))
            )
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
        if self.model_config.kv_window is not None:
            self._add_window_rows(inputs, seqs)
        if self.state is not None:
            self._add_state_rows(inputs, seqs)
        return inputs, [seqs[i] for i in rows]

    def _add_window_rows(self, inputs: StepInputs, seqs: list[Sequence]) -> None:
        """The window layers' slot mapping and block tables (KV groups): the step's positions
        through each sequence's window_table; entries the window has passed (-1) read as 0,
        a block those layers never read for this sequence."""
        bs = self.block_size
        tables = np.zeros(inputs.block_tables.shape, dtype=np.int32)
        for i, seq in enumerate(seqs):
            table = np.frombuffer(seq.window_table, dtype=np.int32)
            tables[i, : len(table)] = np.maximum(table, 0)
        rows = np.repeat(np.arange(len(seqs)), np.diff(inputs.cu_seqlens_q))
        pos = inputs.positions
        inputs.window_block_tables = tables
        inputs.window_slot_mapping = tables[rows, pos // bs].astype(np.int64) * bs + pos % bs

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
        if any(seq.num_spec for seq in seqs):
            inputs.spec_slots = _spec_slots(seqs, np.diff(inputs.cu_seqlens_q), inputs.state_slots)

    def _step_metadata(
        self, inputs: StepInputs
    ) -> tuple[dict[str, torch.Tensor], AttentionMetadata, StateMetadata | None]:
        """An eager step's host arrays on the device (by name: input_ids, positions,
        sample_rows, ...), its attention metadata and, for a hybrid model, its state metadata."""
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
        if inputs.window_block_tables is not None:
            host["window_slot_mapping"] = inputs.window_slot_mapping
            host["window_block_tables"] = inputs.window_block_tables
        if inputs.spec_slots is not None:
            host["spec_slots"] = inputs.spec_slots
        # One pinned staging buffer and one copy for the whole step (device.to_device_many).
        d = dict(zip(host, to_device_many(list(host.values()), self.device), strict=True))
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
        if not decode_only:  # host copies for layers that plan a step on the host (MLA)
            meta.host_cu_seqlens_q = inputs.cu_seqlens_q
            meta.host_seq_lens = inputs.seq_lens
            meta.host_block_tables = inputs.block_tables
        if inputs.window_block_tables is not None:
            meta.window = AttentionMetadata(
                slot_mapping=d["window_slot_mapping"],
                block_tables=d["window_block_tables"],
                seq_lens=meta.seq_lens,
                decode_only=decode_only,
                cu_seqlens_q=meta.cu_seqlens_q,
                max_seqlen_q=meta.max_seqlen_q,
            )
        state_meta = None
        if inputs.state_slots is not None:
            state_meta = StateMetadata(
                query_start_loc=d["cu_seqlens_q"],
                slot_ids=d["state_slots"],
                has_initial_state=d["has_initial_state"],
                spec_slots=d.get("spec_slots"),
                spec_only=inputs.spec_slots is not None
                and bool((inputs.spec_slots[:, 0] >= 0).all()),
            )
        return d, meta, state_meta


def _spec_slots(seqs: list[Sequence], q_lens: np.ndarray, state_slots: np.ndarray) -> np.ndarray:
    """A verify step's per-token state slots (`StepInputs.spec_slots`): a row running drafts or
    one token reads its committed slot and leaves the state after its token i in its slot i;
    a prompt chunk keeps the plain path (its `state_slots` entry), the verified rows leave it
    (-1 there)."""
    width = max(len(seq.state_slots) for seq in seqs)
    out = np.full((len(seqs), width), -1, dtype=np.int32)
    for i, (seq, n) in enumerate(zip(seqs, q_lens.tolist(), strict=True)):
        if seq.num_spec or n == 1:
            out[i, :n] = seq.state_slots[:n]
            state_slots[i] = -1
    return out

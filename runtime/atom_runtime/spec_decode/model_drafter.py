"""What a drafting model does after every step (a draft model, an MTP head): catch its own KV up
on the tokens the target just computed, then propose k tokens, one forward each, greedily.

Its KV cache uses the target's block ids (the same block tables and slots: the runner allocates
its layers beside the target's), so it needs no block manager: every position the target keeps
KV for, the drafter computes too, in the step after; and its k - 1 further inputs go into the
slots the scheduler reserved past the step's tokens (`SpeculativeConfig.lookahead`), overwritten
by the real tokens later. A sequence preempted and readmitted starts over (its catch-up begins at
the target's first position), so the caches stay in step. KV pulled from a prefill engine holds
the target's layers alone (`Sequence.draft_kv_from`): a draft model's first catch-up after the
pull starts at the first pulled position (a prefill of the draft model over the pulled prompt);
an MTP head, which reads the target's hidden states there, cannot, and drafts without that KV.

Positions: a draft model reads token j at position j. An MTP head reads (the target's hidden
state at position j, token j + 1) at position j and predicts token j + 2; its further steps
read its own last hidden state in place of the target's (vLLM's MTP and EAGLE do the same).
Drafts are the argmax (deterministic proposals: the rejection sampler keeps the target's
distribution exactly whatever the drafter proposes).

On a GPU the runner captures the drafting model's steps (worker/draft_graphs.py): the catch-up
of a verify step (at most `catch_up_rows` positions a sequence) and each one-token draft step.
Run eagerly, a step costs a Python launch a kernel, several times its GPU time; steps that do
not fit a graph (the catch-up over a prompt chunk) still run eagerly.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import numpy as np
import torch

from atom_runtime.core.sequence import Sequence
from atom_runtime.layers.forward_context import AttentionMetadata, set_attention_metadata
from atom_runtime.protocol.worker import StepInputs
from atom_runtime.spec_decode.proposer import StepChunk
from atom_runtime.system.device import to_device_many
from atom_runtime.system.distributed import rank_local


@dataclass
class _Round:
    """One sequence's catch-up and drafting."""

    seq: Sequence
    positions: np.ndarray  # int64: the catch-up positions
    tokens: np.ndarray  # int64: the token read at each
    hidden_rows: np.ndarray | None  # int64: the step's rows holding the target's hidden states
    wanted: int  # drafts to propose (0: catch up only)
    drafts: list[int]


class ModelDrafter:
    """The shared loop of drafting models; a subclass runs its model (`_forward`, `_logits`)
    and says where its inputs sit (`token_shift`: 0 for a draft model, 1 for an MTP head)."""

    needs_step_chunks = True
    needs_hidden_states = False
    token_shift = 0
    # Tensor parallelism: built whole on rank 0 and run outside the group (proposer.py).
    outside_group = False

    def __init__(self, k: int, device: torch.device, block_size: int, max_positions: int) -> None:
        self.k = k
        self.device = device
        self.block_size = block_size
        self.max_positions = max_positions  # rotary tables end there
        # The captured steps, set by the model runner on a GPU (worker/draft_graphs.DrafterGraphs:
        # `catch_up.replay(StepInputs, before)` and `drafts[layer].replay(StepInputs, None)` give
        # logits, or None when no graph fits, and leave `last_hidden`).
        self.graphs = None

    @property
    def catch_up_rows(self) -> int:
        """The most positions a sequence's catch-up after a verify step reads: the step's k + 1
        rows, and for a draft model the new last token too."""
        return self.k + 2 - self.token_shift

    def layer_of(self, step: int) -> int:
        """Which of the drafting model's step modules draft `step` runs (an MTP head with several
        layers uses them in turn; a draft model has one)."""
        return 0

    def draft_layers(self) -> set[int]:
        """The step modules drafts 2..k run: one set of draft graphs each."""
        return {self.layer_of(step) for step in range(1, self.k)}

    def graph_model(self, layer: int, max_rows: int) -> torch.nn.Module:
        """What a captured step runs: a module of (ids, positions) with `compute_logits`,
        reading at most `max_rows` rows."""
        raise NotImplementedError

    def attention_layers(self) -> list:
        raise NotImplementedError

    def group(self) -> AbstractContextManager:
        """The group the drafting model runs in: this rank alone under tensor parallelism."""
        return rank_local() if self.outside_group else nullcontext()

    def _forward(self, ids, positions, hidden: torch.Tensor | None, step: int) -> torch.Tensor:
        """The model's final hidden states over the rows; `step`: 0 for the catch-up, i for
        draft i + 1."""
        raise NotImplementedError

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def propose(
        self, seqs: list[Sequence], chunks: list[StepChunk | None], hidden: torch.Tensor | None
    ) -> list[list[int]]:
        rounds = [self._round(seq, chunk) for seq, chunk in zip(seqs, chunks, strict=True)]
        live = [r for r in rounds if r is not None and len(r.positions)]
        if live:
            with self.group():
                # Each live round's drafts, kept on the device until the last one is known: the
                # chain of draft steps runs without waiting for the host.
                chain = torch.zeros(len(live), self.k, dtype=torch.int64, device=self.device)
                last = self._catch_up(live, hidden, chain)
                self._draft(live, last, chain)
                for r, ids in zip(live, chain.tolist(), strict=True):
                    r.drafts = ids[: r.wanted]
        return [r.drafts if r is not None else [] for r in rounds]

    def _round(self, seq: Sequence, chunk: StepChunk | None) -> _Round | None:
        """What seq's catch-up reads, and how many drafts its slots leave room for."""
        if chunk is None:
            return None
        shift = self.token_shift
        ready = seq.num_computed_tokens == seq.num_tokens - 1
        # A draft model also reads the last token (its KV is the target's next input's);
        # an MTP head pairs each computed position with the token after it.
        end = seq.num_tokens - shift if ready else seq.num_computed_tokens
        capacity = min(len(seq.block_table) * self.block_size, self.max_positions)
        if end > capacity:  # the step's lookahead slots did not fit: the next catch-up reads on
            end, ready = capacity, False
        start = chunk.start
        if seq.draft_kv_from is not None and not self.needs_hidden_states:
            start = min(start, seq.draft_kv_from)
        positions = np.arange(start, end, dtype=np.int64)
        tokens = np.frombuffer(seq.token_ids, dtype=np.int32)[start + shift : end + shift]
        rows = None
        if self.needs_hidden_states:
            rows = np.arange(chunk.row, chunk.row + len(positions), dtype=np.int64)
        wanted = 0
        if ready and len(positions):
            # Draft i + 1 is read at position end - 1 + i: its slot must be allocated.
            wanted = max(0, min(self.k, capacity - end + 1))
        return _Round(seq, positions, tokens.astype(np.int64), rows, wanted, [])

    def _catch_up(
        self, live: list[_Round], hidden: torch.Tensor | None, chain: torch.Tensor
    ) -> torch.Tensor:
        """One forward over every round's catch-up positions; the first drafts (`chain`'s first
        column) from each last row. Returns the last row's hidden state of each round."""
        lens = [len(r.positions) for r in live]
        cu = np.zeros(len(live) + 1, dtype=np.int32)
        np.cumsum(lens, out=cu[1:])
        positions = np.concatenate([r.positions for r in live])
        tokens = np.concatenate([r.tokens for r in live])
        inputs = self._inputs(live, tokens, positions, cu, max(lens))
        prev = None
        if self.needs_hidden_states:
            rows = np.concatenate([r.hidden_rows for r in live])
            prev = hidden[torch.from_numpy(rows).to(hidden.device)]
        ends = torch.from_numpy(cu[1:] - 1).to(self.device, dtype=torch.int64)
        logits = self._replay_catch_up(inputs, prev)
        if logits is not None:
            chain[:, 0] = logits.index_select(0, ends).argmax(dim=-1)
            return self.graphs.catch_up.last_hidden.index_select(0, ends)
        last = self._run(inputs, prev).index_select(0, ends)
        chain[:, 0] = self._logits(last).argmax(dim=-1)
        return last

    def _replay_catch_up(self, inputs: StepInputs, prev) -> torch.Tensor | None:
        """The catch-up's logits through a captured graph, or None (none fits)."""
        if self.graphs is None:
            return None
        before = None if prev is None else lambda index: self._fill_previous(index, prev)
        return self.graphs.catch_up.replay(inputs, before)

    def _fill_previous(self, index: torch.Tensor, prev: torch.Tensor) -> None:
        """Put the hidden states a captured step reads (`prev`) at its rows `index`."""
        raise NotImplementedError

    def _draft(self, live: list[_Round], last: torch.Tensor, chain: torch.Tensor) -> None:
        """Drafts 2..k (`chain`'s further columns): one single-token forward each, over the
        rounds still wanting more, its input the previous draft still on the device."""
        for step in range(1, self.k):
            keep = [i for i, r in enumerate(live) if r.wanted > step]
            if not keep:
                return
            rounds = [live[i] for i in keep]
            positions = np.asarray([r.positions[-1] + step for r in rounds], dtype=np.int64)
            cu = np.arange(len(rounds) + 1, dtype=np.int32)
            # The ids are on the device (`ids`); the staged ones are placeholders.
            inputs = self._inputs(rounds, np.zeros(len(rounds), np.int64), positions, cu, 1)
            rows = torch.tensor(keep, device=self.device)
            ids = chain[:, step - 1].index_select(0, rows)
            prev = last.index_select(0, rows) if self.needs_hidden_states else None
            graphs = self.graphs.drafts.get(self.layer_of(step)) if self.graphs else None
            if graphs is not None and prev is not None:
                self._fill_previous(torch.arange(len(rounds), device=self.device), prev)
            logits = graphs.replay(inputs, None, ids) if graphs is not None else None
            if logits is not None:
                out = graphs.last_hidden
            else:
                out = self._run(inputs, prev, step, ids)
                logits = self._logits(out)
            chain[:, step].index_copy_(0, rows, logits.argmax(dim=-1))
            if self.needs_hidden_states:
                last = last.index_copy(0, rows, out)

    def _inputs(self, rounds: list[_Round], tokens, positions, cu, max_q: int) -> StepInputs:
        """A drafting step over packed rows of `rounds` (cu: each round's row offsets), its KV
        written at the rounds' slots (the target's block tables); every row samples."""
        bs = self.block_size
        width = max(len(r.seq.block_table) for r in rounds)
        tables = np.zeros((len(rounds), width), dtype=np.int32)
        slots = np.empty(len(positions), dtype=np.int64)
        ends = np.empty(len(rounds), dtype=np.int32)
        for i, r in enumerate(rounds):
            table = np.frombuffer(r.seq.block_table, dtype=np.int32)
            tables[i, : len(table)] = table
            pos = positions[cu[i] : cu[i + 1]]
            slots[cu[i] : cu[i + 1]] = table[pos // bs].astype(np.int64) * bs + pos % bs
            ends[i] = pos[-1] + 1
        return StepInputs(
            input_ids=tokens,
            positions=positions,
            slot_mapping=slots,
            block_tables=tables,
            seq_lens=ends,
            cu_seqlens_q=cu,
            max_seqlen_q=max_q,
            sample_rows=np.arange(len(positions), dtype=np.int64),
        )

    def _run(self, inputs: StepInputs, prev, step: int = 0, ids=None) -> torch.Tensor:
        """The drafting model eagerly over a step's rows (`ids`: their ids already on the
        device, else the staged ones); the hidden states of every row."""
        d = to_device_many(
            [inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.block_tables,
             inputs.seq_lens, inputs.cu_seqlens_q],
            self.device,
        )  # fmt: skip
        decode = inputs.max_seqlen_q == 1
        meta = AttentionMetadata(
            slot_mapping=d[2],
            block_tables=d[3],
            seq_lens=d[4],
            decode_only=decode,
            cu_seqlens_q=None if decode else d[5],
            max_seqlen_q=inputs.max_seqlen_q,
        )
        set_attention_metadata(meta)
        try:
            return self._forward(d[0] if ids is None else ids, d[1], prev, step)
        finally:
            set_attention_metadata(None)

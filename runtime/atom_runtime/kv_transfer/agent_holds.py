"""The producer's half of `TransferAgent`: holding a finished prompt's blocks for its consumer.

A request that arrives with `kv_transfer_params.do_remote_decode` runs as usual (the router sends
max_tokens=1); when it finishes, its full prompt blocks get one extra reference under a fresh
random transfer id, offered on every rank, and the request's returned `kv_transfer_reply` says
where they are (engine id, host, rank 0's port, tensor-parallel size, block ids and hashes). The
hold ends when the consumer releases it (after its pull, or when its request was aborted) or after
`hold_timeout_s` (counted), never while a rank's blocks are being read. The blocks then go back to
the pool with their hashes, as cached blocks. At most `max_held_fraction` of the pool is held at
once; a prompt finishing beyond it is answered with no blocks (the decode pod prefills it).

A hybrid model's hold also keeps the state checkpoint at the consumer's resume point
(state_handoff.py): its units are offered with the blocks once the checkpoint is READY (pinned
until the hold ends); a prompt without one is answered with no blocks.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass, field

from atom_runtime.core.sequence import FinishReason, Sequence
from atom_runtime.kv_transfer.state_handoff import resume_blocks
from atom_runtime.protocol.block_hash import hash_token_blocks
from atom_runtime.state.checkpoint_record import CheckpointRef

log = logging.getLogger(__name__)


@dataclass
class _Hold:
    block_ids: list[int]
    deadline: float
    released: bool = False
    state: CheckpointRef | None = None  # a hybrid model's checkpoint at the resume point
    units: list[int] = field(default_factory=list)  # its blocks
    offered: bool = False  # offered to the transport (a state hold: once its checkpoint pinned)


def chain_hashes(seq: Sequence, block_size: int, num_blocks: int) -> list[int]:
    """The chained hashes of seq's first num_blocks blocks (from its cache_salt's root)."""
    tokens = seq.token_ids[: num_blocks * block_size]
    return hash_token_blocks(tokens, block_size, seq.hash_root)


class HoldKeeper:
    """Needs the agent's config, pool, block_size, connector, states, tp_size, stats, holds,
    max_held and _warn_full."""

    def on_finished(self, seq: Sequence) -> None:
        """A request finished: hold its prompt blocks if a consumer will pull them. Called
        before the scheduler frees the request's blocks."""
        params = seq.kv_transfer_params
        if not self.config.is_producer or not params or not params.get("do_remote_decode"):
            return
        if seq.finish_reason is FinishReason.ABORT:
            return
        bs = self.block_size
        n = min(seq.num_prompt_tokens, seq.num_computed_tokens) // bs
        n = min(n, len(seq.block_table))
        if self.states is not None:
            n = min(n, resume_blocks(seq.num_prompt_tokens, bs))
        if n and self.stats.held_blocks + n > self.max_held:
            self._warn_full(
                "KV holds are full (%d blocks held, at most %d): %s is not held; its decode pod "
                "prefills it",
                self.stats.held_blocks,
                self.max_held,
                seq.request_id,
            )
            self.stats.holds_refused += 1
            n = 0
        hashes = chain_hashes(seq, bs, n)
        state = self.states.find(hashes[-1]) if self.states is not None and n else None
        if self.states is not None and n and state is None:
            self._warn_full(
                "no state checkpoint at the resume point of %s (no room for one): not held; its "
                "decode pod prefills it",
                seq.request_id,
            )
            self.stats.holds_refused += 1
            n, hashes = 0, []
        tid = secrets.token_hex(16)
        if n:
            self._hold(tid, list(seq.block_table[:n]), state)
        self._reply(seq, tid, n, hashes, state)

    def _hold(self, tid: str, block_ids: list[int], state) -> None:
        for block_id in block_ids:
            self.pool.claim(block_id)
        hold = _Hold(block_ids, time.monotonic() + self.config.hold_timeout_s)
        if state is not None:
            hold.state, hold.units = state
        self.holds[tid] = hold
        self.stats.held_blocks += len(block_ids)
        if state is None:
            self.connector.offer(tid, block_ids)
            hold.offered = True

    def _reply(self, seq: Sequence, tid: str, n: int, hashes: list[int], state) -> None:
        host, port = self.connector.address()
        reply = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.connector.engine_id,
            "remote_host": host,
            "remote_port": port,
            "remote_request_id": tid,
            "remote_block_ids": list(seq.block_table[:n]),
            "remote_block_hashes": hashes,
            "remote_num_tokens": seq.num_prompt_tokens,
            "tp_size": self.tp_size,
        }
        if state is not None:
            reply["remote_state_block_ids"] = list(state[1])
            reply["remote_state_tokens"] = n * self.block_size
        seq.kv_transfer_reply = reply

    def _offer_states(self) -> None:
        """Offer the holds whose state checkpoint became READY (its copy rode the request's
        last batch); a checkpoint gone meanwhile ends its hold (the pull then fails)."""
        for tid, hold in self.holds.items():
            if hold.offered or hold.state is None:
                continue
            pinned = self.states.try_pin(hold.state)
            if pinned:
                self.connector.offer(tid, hold.block_ids + hold.units)
                hold.offered = True
            elif pinned is None:
                log.warning("the state checkpoint of KV hold %s went before it was offered", tid)
                hold.state = None
                hold.deadline = 0.0

    def _end_holds(self) -> None:
        for tid in self.connector.released():
            hold = self.holds.get(tid)
            if hold is not None:
                hold.released = True
        if self.states is not None:
            self._offer_states()
        now = time.monotonic()
        for tid, hold in list(self.holds.items()):
            if not hold.released and hold.deadline > now:
                continue
            if hold.offered and not self.connector.withdraw(tid):
                continue  # a read is in progress: next poll
            del self.holds[tid]
            self.pool.free(hold.block_ids[::-1])
            if hold.offered and hold.state is not None:
                self.states.unpin(hold.state)
            self.stats.held_blocks -= len(hold.block_ids)
            if hold.released:
                self.stats.holds_released += 1
            else:
                self.stats.hold_timeouts += 1
                log.warning(
                    "KV hold %s expired unpulled; %d blocks freed", tid, len(hold.block_ids)
                )

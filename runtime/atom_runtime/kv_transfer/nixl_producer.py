"""The producer's side of the NIXL connector: grant reads of held blocks, know when they end.

A `NixlPull` is checked like the portable transport's pull (protocol version, the transfer key's
seal, a finite timeout of at most MAX_PULL_TIMEOUT_S, the KV layout, unique block ids all in the
hold, heads inside this rank's, at most MAX_TICKETS_PER_PEER reads at once from one address)
before it is granted: the grant carries this rank's NIXL agent name, its metadata (unless the
consumer says it has it) and cache geometry, and a random ticket. From then on the blocks count
as being read (the hold is not withdrawn) until the consumer's sealed completion note arrives
through NIXL, the consumer releases the transfer, or the pull's timeout passes.

The read itself never involves this side: the consumer's NIXL agent reads the registered cache.
`NixlProducer` is a part of `NixlConnector` (nixl.py) and runs on its control thread.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass

from atom_runtime.kv_transfer.holds import MAX_TICKETS_PER_PEER, OfferBook, refused_pull
from atom_runtime.kv_transfer.nixl_wire import PROTOCOL, NixlGrant, NixlPull, read_note

log = logging.getLogger(__name__)

MAX_AGENT_NAME = 256
MAX_NOTELESS = 1024  # released reads whose note may still come, newest kept


@dataclass(eq=False)
class _Read:
    """One granted read, until its note, its transfer's release or its deadline."""

    ticket: str
    transfer_id: str
    deadline: float
    peer: str
    agent: str  # the consumer's NIXL agent: its note must come from it
    blocks: int
    nbytes: int


class NixlProducer(OfferBook):
    def _init_producer(self) -> None:
        self._init_offers()
        self._reads: dict[str, _Read] = {}  # by ticket
        # Reads ended by their transfer's release before their note came: NIXL may deliver the
        # note after the consumer's release (another channel), and it still counts as sent.
        self._noteless: OrderedDict[str, _Read] = OrderedDict()
        self.blocks_sent = 0
        self.bytes_sent = 0

    def address(self) -> tuple[str, int]:
        return self._advertised, self._port

    # -- control thread --------------------------------------------------------------------------

    def _on_release(self, transfer_id: str) -> None:
        """Under the lock: a consumer releases only once none of its reads is in flight."""
        for read in [r for r in self._reads.values() if r.transfer_id == transfer_id]:
            self._end(read, done=False)
            self._noteless[read.ticket] = read
            while len(self._noteless) > MAX_NOTELESS:
                self._noteless.popitem(last=False)
        self._released.append(transfer_id)

    def _grant(self, msg: NixlPull, peer: str) -> NixlGrant:
        """Check a pull and register its read (the blocks count as being read from now on)."""
        tid = msg.transfer_id
        error = refused_pull(msg, self.seal, self.kv, PROTOCOL, "NIXL transfer")
        if error is None and not 0 < len(msg.agent) <= MAX_AGENT_NAME:
            error = "a read without the consumer's NIXL agent name"
        if error is not None:
            return NixlGrant(tid, error)
        nbytes = len(msg.block_ids) * self.kv.restrict(msg.heads).block_bytes
        with self._lock:
            error, fence = self._grant_error(tid, msg.block_ids)
            if error is None and (
                sum(r.peer == peer for r in self._reads.values()) >= MAX_TICKETS_PER_PEER
            ):
                error = f"more than {MAX_TICKETS_PER_PEER} reads at once"
            if error is not None:
                return NixlGrant(tid, error)
            read = _Read(
                secrets.token_hex(16),
                tid,
                time.monotonic() + msg.timeout_s + 1.0,
                peer,
                msg.agent,
                len(msg.block_ids),
                nbytes,
            )
            self._reads[read.ticket] = read
            self._start_read(tid)
        if fence is not None:
            fence.synchronize()  # the blocks' last writes are done before anyone reads them
        g = self.geometry
        return NixlGrant(
            tid,
            agent=self.agent_name,
            metadata=b"" if msg.agent_has == self.agent_name else self.metadata,
            regions=g.regions,
            device=g.device,
            memory=g.memory,
            block_bytes=g.block_bytes,
            row_bytes=g.row_bytes,
            head_bytes=g.head_bytes,
            block_size=g.block_size,
            ticket=read.ticket,
        )

    def _take_notes(self) -> None:
        """Reads that finished: NIXL delivered their consumers' notes."""
        notes = self.agent.get_new_notifs()
        if not notes:
            return
        with self._lock:
            for agent, messages in notes.items():
                for note in messages:
                    ticket = read_note(self.seal.key, note) or ""
                    read = self._reads.get(ticket)
                    if read is not None and read.agent == agent:
                        self._end(read, done=True)
                        continue
                    late = self._noteless.get(ticket)
                    if late is not None and late.agent == agent:
                        del self._noteless[ticket]
                        self._count_sent(late)

    def _expire_producer(self, now: float) -> None:
        with self._lock:
            for read in [r for r in self._reads.values() if r.deadline <= now]:
                self._end(read, done=False)

    def _end(self, read: _Read, done: bool) -> None:
        """Under the lock: a read is over (`done`: its note said it completed)."""
        if self._reads.pop(read.ticket, None) is None:
            return
        self._end_read(read.transfer_id)
        if done:
            self._count_sent(read)

    def _count_sent(self, read: _Read) -> None:
        self.blocks_sent += read.blocks
        self.bytes_sent += read.nbytes

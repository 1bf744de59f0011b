"""The engine's side of prefill/decode disaggregation: block holds and pulls, over any transport.

Producer (a prefill engine): agent_holds.py, `HoldKeeper`.

Consumer (a decode engine): a request carrying `do_remote_prefill` params is parked before the
scheduler sees it. The agent checks the producer's block hashes against its own hashes of the
prompt, claims its local prefix hits (never re-sent), allocates blocks for the rest and pulls only
those: the transport writes the bytes into them off the engine thread, each rank its own heads
from the producer ranks holding them (fanout.py). On success the blocks are hashed into the
prefix cache (so KV events announce them as stored) and released, and the request enters the
scheduler, which finds them as prefix hits: the decode engine computes only the prompt's last
block. On failure or timeout the blocks are freed and the request is prefilled locally (counted).
An aborted pull's blocks are freed once the transport has stopped writing them. The scheduler
needs no change.

A hybrid model also pulls the producer's state checkpoint at the resume point into a checkpoint
record of its own, published READY with the blocks (state_handoff.py), unless it holds one there
already; the scheduler resumes from it as from any checkpoint. Both engines must run the same
tensor-parallel size then (each rank's image is its shard's).

Trust: with the deployment's key (kv_transfer/auth.py) the agent acts on no kv_transfer_params
the router did not sign (`open_params`), so only the router can make a producer hold blocks or
tell a consumer whom to dial.

Contract 2 holds on both sides: the consumer never takes the prompt's last block remotely.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import msgspec

from atom_runtime.core.block_manager import BlockManager
from atom_runtime.core.sequence import FinishReason, Sequence
from atom_runtime.kv_transfer.agent_holds import HoldKeeper, _Hold, chain_hashes
from atom_runtime.kv_transfer.auth import TransferKey
from atom_runtime.kv_transfer.base import KVCacheAccess, KVConnector, RemoteBlocks
from atom_runtime.kv_transfer.config import KVTransferConfig
from atom_runtime.kv_transfer.state_handoff import StateHandoff, resume_blocks
from atom_runtime.protocol.kv_transfer_stats import KVTransferStats
from atom_runtime.state.checkpoint_record import StagedCheckpoint
from atom_runtime.state.engine_checkpoints import EngineCheckpoints
from atom_runtime.system.log_limit import RateLimitedLog

log = logging.getLogger(__name__)

MAX_TP = 1024


@dataclass
class _Pull:
    seq: Sequence
    remote: RemoteBlocks
    hits: list[int]  # local prefix-hit blocks, claimed for the pull's duration
    blocks: list[int]  # local blocks the pulled data goes into
    hashes: list[int]  # the chained hashes of blocks [0, start + len(blocks))
    start: int  # index of the first pulled block in the prompt
    staged: StagedCheckpoint | None = None  # a hybrid model's checkpoint the pull fills


def _remote_params(params: dict) -> tuple[RemoteBlocks, list[int], tuple[list[int], int] | None]:
    """The producer's address, blocks, hashes and (hybrid models) state checkpoint units and
    position out of kv_transfer_params (ValueError naming the field if bad)."""
    ids = params.get("remote_block_ids")
    hashes = params.get("remote_block_hashes")
    host, port, tid = (
        params.get("remote_host"),
        params.get("remote_port"),
        params.get("remote_request_id"),
    )
    if not isinstance(ids, list) or not all(type(b) is int and b >= 0 for b in ids):
        raise ValueError("kv_transfer_params.remote_block_ids: must be a list of block ids")
    if len(set(ids)) != len(ids):
        raise ValueError("kv_transfer_params.remote_block_ids: a block id appears twice")
    if not isinstance(hashes, list) or not all(type(h) is int for h in hashes):
        raise ValueError("kv_transfer_params.remote_block_hashes: must be a list of ints")
    if not isinstance(host, str) or not host:
        raise ValueError("kv_transfer_params.remote_host: must be the producer's address")
    if type(port) is not int or not 0 < port < 65536:
        raise ValueError("kv_transfer_params.remote_port: must be a port number")
    if not isinstance(tid, str) or not tid:
        raise ValueError("kv_transfer_params.remote_request_id: must be the transfer id")
    tp = params.get("tp_size", 1)
    if type(tp) is not int or not 1 <= tp <= MAX_TP:
        raise ValueError(f"kv_transfer_params.tp_size: must be in 1..{MAX_TP}, got {tp!r}")
    units, tokens = params.get("remote_state_block_ids"), params.get("remote_state_tokens")
    state = None
    if units is not None:
        if not isinstance(units, list) or not all(type(b) is int and b >= 0 for b in units):
            raise ValueError("kv_transfer_params.remote_state_block_ids: must be block ids")
        if type(tokens) is not int or tokens < 0:
            raise ValueError("kv_transfer_params.remote_state_tokens: must be a token count")
        if set(units) & set(ids) or len(set(units)) != len(units):
            raise ValueError("kv_transfer_params.remote_state_block_ids: a block id twice")
        state = (units, tokens)
    return RemoteBlocks(tid, host, port, ids, tp_size=tp), hashes, state


class TransferAgent(HoldKeeper):
    def __init__(
        self,
        config: KVTransferConfig,
        block_manager: BlockManager,
        kv: KVCacheAccess,
        connector: KVConnector | None = None,
        checkpoints: EngineCheckpoints | None = None,
        tp_size: int = 1,
    ) -> None:
        """`checkpoints`: a hybrid model's state checkpoints (its state travels as one);
        `tp_size`: this engine's tensor-parallel size (`connector` drives every rank)."""
        self.config = config
        self.block_manager = block_manager
        self.pool = block_manager.pool
        self.block_size = block_manager.block_size
        self.kv = kv
        self.key: TransferKey | None = config.load_key()
        if self.key is None:
            log.warning(
                "KV transfer runs without a key (kv_connector_extra_config.insecure): any "
                "client may ask for transfers and read or write KV blocks; never in production"
            )
        if connector is None:
            from atom_runtime.kv_transfer.tcp import TCPConnector

            connector = TCPConnector(config, kv)
        self.connector = connector
        self.states = StateHandoff(checkpoints) if checkpoints is not None else None
        self.tp_size = tp_size
        self.max_held = max(1, int(config.max_held_fraction * self.pool.num_blocks))
        self._warn_full = RateLimitedLog(log, 10.0)
        self.holds: dict[str, _Hold] = {}
        self.pulls: dict[str, _Pull] = {}  # by transfer id
        self.draining: dict[str, _Pull] = {}  # aborted; freed once the transport lets go
        self.stats = KVTransferStats()

    def open_params(self, params: dict) -> dict:
        """The kv_transfer_params a request may act on: the router's signature checked and taken
        off (with a key), the role checked. ValueError naming the field otherwise."""
        if self.key is not None:
            params = self.key.open_params(params)
        if params.get("do_remote_decode") and not self.config.is_producer:
            raise ValueError("kv_transfer_params.do_remote_decode: this engine is not a producer")
        if params.get("do_remote_prefill") and not self.config.is_consumer:
            raise ValueError("kv_transfer_params.do_remote_prefill: this engine is not a consumer")
        return params

    # -- consumer --------------------------------------------------------------------------------

    def park(self, seq: Sequence) -> bool:
        """True when `seq` waits for a pull (the caller must not schedule it yet); False when it
        goes to the scheduler now. Malformed params raise ValueError before anything is held."""
        params = seq.kv_transfer_params
        if not params:
            return False
        if params.get("do_remote_decode") and self.states is not None and self.config.is_producer:
            self.states.mark(seq.request_id, seq.num_prompt_tokens)
        if not self.config.is_consumer or not params.get("do_remote_prefill"):
            return False
        remote, remote_hashes, state = _remote_params(params)
        bs = self.block_size
        # Contract 2: the prompt's last block is always computed here.
        usable = min(
            len(remote.block_ids), len(remote_hashes), resume_blocks(seq.num_prompt_tokens, bs)
        )
        own = chain_hashes(seq, bs, usable)
        usable = next((i for i in range(usable) if own[i] != remote_hashes[i]), usable)
        refused = self._refusal(remote, usable, state)
        prefix_ok = (
            self.block_manager.enable_prefix_caching and seq.sampling_params.prompt_logprobs is None
        )
        hits = self.block_manager.find_prefix_hit(seq)[:usable] if prefix_ok and usable else []
        need = usable - len(hits)
        want_state = (
            self.states is not None and usable > 0 and not self.states.has_ready(own, usable)
        )
        busy = remote.transfer_id in self.pulls or remote.transfer_id in self.draining
        if refused is None and (not prefix_ok or (need <= 0 and not want_state) or busy):
            refused = ""  # nothing to pull: not a failure
        if refused is None:
            refused = self._room(seq, hits, need, want_state)
        staged = None
        if refused is None and want_state:
            staged = self.states.stage(own[usable - 1], usable)
            if staged is None:
                refused = "no room for the state checkpoint it brings"
        if refused is not None:
            if refused:
                log.warning("not pulling KV for %s (%s); prefilling locally", seq, refused)
                self.stats.fallbacks += 1
            self.stats.blocks_local_hit += len(hits)
            self.connector.release_remote(remote.host, remote.port, remote.transfer_id)
            return False
        self._start(seq, remote, own[:usable], hits, need, state, staged)
        return True

    def _refusal(self, remote: RemoteBlocks, usable: int, state) -> str | None:
        """Why a transfer cannot be used here at all (None: it can)."""
        error = self.connector.plan_error(remote.tp_size)
        if error is not None or self.states is None or usable == 0:
            return error
        if remote.tp_size != self.tp_size:
            return (
                f"a hybrid model's state moves rank by rank: the prefill engine runs "
                f"tensor_parallel_size {remote.tp_size}, this one {self.tp_size}"
            )
        if state is None or len(state[0]) != self.states.units_per_image:
            return "the prefill engine sent no state checkpoint of this layout"
        if usable != len(remote.block_ids) or state[1] != usable * self.block_size:
            return "the prefill engine's state is not at this prompt's resume point"
        return None

    def _room(self, seq: Sequence, hits: list[int], need: int, want_state: bool) -> str | None:
        idle_hits = sum(1 for b in hits if self.pool.blocks[b].ref_count == 0)
        units = self.states.units_per_image if want_state else 0
        if max(need, 0) + idle_hits + units > self.pool.num_free_blocks:
            return f"no room for {max(need, 0) + units} blocks"
        return None

    def _start(self, seq, remote, hashes, hits, need, state, staged) -> None:
        """Claim the local hits, allocate the rest and start the pull."""
        for block_id in hits:
            self.pool.claim(block_id)
        blocks = self.pool.allocate(max(need, 0))
        start = len(hits)
        remote_ids = remote.block_ids[start : len(hashes)]
        local_ids = list(blocks)
        if staged is not None:
            remote_ids = remote_ids + list(state[0])
            local_ids += staged.units
        wanted = RemoteBlocks(
            remote.transfer_id, remote.host, remote.port, remote_ids, tp_size=remote.tp_size
        )
        self.pulls[remote.transfer_id] = _Pull(seq, wanted, hits, blocks, hashes, start, staged)
        self.stats.blocks_local_hit += start
        self.stats.pulls_in_flight += 1
        self.connector.start_pull(wanted, local_ids, self.config.pull_timeout_s)

    def _finish_pull(self, pull: _Pull, nbytes: int) -> None:
        """Place the pulled blocks (the transport wrote them) in the prefix cache, and a pulled
        state checkpoint in the store; the caller then lets go of every block the pull held, and
        the scheduler's prefix lookup claims them again at once."""
        bs = self.block_size
        first = pull.start
        tokens = [
            pull.seq.token_ids[i * bs : (i + 1) * bs]
            for i in range(first, first + len(pull.blocks))
        ]
        if pull.blocks:
            # The producer's blocks carry the target's layers alone: a drafting model here
            # catches up on them with the sequence's first step.
            pull.seq.draft_kv_from = first * bs
            self.pool.publish_hashes(
                pull.blocks,
                pull.hashes[first:],
                tokens,
                parent=pull.hashes[first - 1] if first else None,
            )
        if pull.staged is not None:
            self.states.received(pull.staged.ref)
            pull.staged = None
        self.stats.pulls_ok += 1
        self.stats.blocks_received += len(pull.blocks)
        self.stats.bytes_received += nbytes

    def _release_local(self, pull: _Pull) -> None:
        self.pool.free(pull.blocks[::-1] + pull.hits[::-1])
        if pull.staged is not None:  # failed or aborted: the transport no longer writes it
            self.states.drop(pull.staged.ref)
        self.stats.pulls_in_flight -= 1
        r = pull.remote
        self.connector.release_remote(r.host, r.port, r.transfer_id)

    # -- the engine loop -------------------------------------------------------------------------

    def poll(self) -> list[Sequence]:
        """End holds that are done, and finish pulls; returns requests ready to schedule."""
        if self.holds:
            self._end_holds()
        ready: list[Sequence] = []
        for result in self.connector.completed():
            drained = self.draining.pop(result.transfer_id, None)
            if drained is not None:  # aborted: the transport has let go of its blocks
                self._release_local(drained)
                continue
            pull = self.pulls.pop(result.transfer_id, None)
            if pull is None:
                continue  # aborted meanwhile
            if result.error is None:
                self._finish_pull(pull, result.nbytes)
            else:
                self.stats.fallbacks += 1
                log.warning(
                    "KV pull for %s failed (%s); prefilling locally",
                    pull.seq.request_id,
                    result.error,
                )
            self._release_local(pull)
            ready.append(pull.seq)
        return ready

    def abort(self, request_ids: set[str]) -> list[Sequence]:
        """Abort parked requests: cancel their pulls, free their blocks, release the producer."""
        aborted = []
        for tid, pull in list(self.pulls.items()):
            if pull.seq.request_id in request_ids:
                del self.pulls[tid]
                if self.connector.cancel_pull(tid):
                    self._release_local(pull)
                else:  # a stripe is still writing into the blocks: freed when it stops
                    self.draining[tid] = pull
                pull.seq.finish(FinishReason.ABORT)
                aborted.append(pull.seq)
        return aborted

    def is_parked(self, request_id: str) -> bool:
        return any(pull.seq.request_id == request_id for pull in self.pulls.values())

    def has_work(self) -> bool:
        return bool(self.pulls or self.holds or self.draining)

    def wait(self, timeout_s: float) -> None:
        self.connector.wait(timeout_s)

    def snapshot(self) -> KVTransferStats:
        s = msgspec.structs.replace(self.stats)
        s.blocks_sent = getattr(self.connector, "blocks_sent", 0)
        s.bytes_sent = getattr(self.connector, "bytes_sent", 0)
        return s

    def close(self) -> None:
        self.connector.close()

"""The engine's side of prefill/decode disaggregation: block holds and pulls, over any transport.

Producer (a prefill engine): a request that arrives with `kv_transfer_params.do_remote_decode`
runs as usual (the router sends max_tokens=1); when it finishes, its full prompt blocks get one
extra reference under a transfer id and the request's returned `kv_transfer_params` say where
they are (engine id, host, port, block ids, block hashes). The hold ends when the consumer
releases it (after its pull, or when its request was aborted) or after `hold_timeout_s`
(counted). Either way the blocks go back to the pool with their hashes, as cached blocks.

Consumer (a decode engine): a request carrying `do_remote_prefill` params is parked before the
scheduler sees it. The agent checks the producer's block hashes against its own hashes of the
prompt, claims its local prefix hits (never re-sent), allocates blocks for the rest and pulls only
those: the transport writes the bytes into them off the engine thread. On success the blocks are
hashed into the prefix cache (so KV events announce them as stored) and released, and the request
enters the scheduler, which finds them as prefix hits: the decode engine computes only the
prompt's last block. On failure or timeout the blocks are freed and the request is prefilled
locally (counted). An aborted pull's blocks are freed once the transport has stopped writing them.
The scheduler needs no change.

Trust: with the deployment's key (kv_transfer/auth.py) the agent acts on no kv_transfer_params
the router did not sign (`open_params`), so only the router can make a producer hold blocks or
tell a consumer whom to dial. A producer holds at most `max_held_fraction` of its pool at once;
a prompt finishing beyond that is answered with no blocks (the decode pod prefills it).

Contract 2 holds on both sides: the consumer never takes the prompt's last block remotely.
Hybrid models (recurrent state) would also need the state image at the prompt end; the seam for it
is here (a transfer carries blocks only today, and hybrid models are refused at startup by
`make_transfer_agent`).
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass

import msgspec

from atom_runtime.core.block_manager import BlockManager
from atom_runtime.core.sequence import FinishReason, Sequence
from atom_runtime.kv_transfer.auth import TransferKey
from atom_runtime.kv_transfer.base import KVCacheAccess, KVConnector, RemoteBlocks
from atom_runtime.kv_transfer.config import KVTransferConfig
from atom_runtime.protocol.block_hash import hash_token_blocks
from atom_runtime.protocol.kv_transfer_stats import KVTransferStats
from atom_runtime.system.log_limit import RateLimitedLog

log = logging.getLogger(__name__)


@dataclass
class _Hold:
    block_ids: list[int]
    deadline: float
    released: bool = False


@dataclass
class _Pull:
    seq: Sequence
    remote: RemoteBlocks
    hits: list[int]  # local prefix-hit blocks, claimed for the pull's duration
    blocks: list[int]  # local blocks the pulled data goes into
    hashes: list[int]  # the chained hashes of blocks [0, start + len(blocks))
    start: int  # index of the first pulled block in the prompt


def _chain_hashes(seq: Sequence, block_size: int, num_blocks: int) -> list[int]:
    """The chained hashes of seq's first num_blocks blocks (from its cache_salt's root)."""
    tokens = seq.token_ids[: num_blocks * block_size]
    return hash_token_blocks(tokens, block_size, seq.hash_root)


def _remote_params(params: dict) -> tuple[RemoteBlocks, list[int]]:
    """The producer's address, blocks and hashes out of kv_transfer_params (ValueError if bad)."""
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
    return RemoteBlocks(tid, host, port, ids), hashes


class TransferAgent:
    def __init__(
        self,
        config: KVTransferConfig,
        block_manager: BlockManager,
        kv: KVCacheAccess,
        connector: KVConnector | None = None,
    ) -> None:
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

    # -- producer --------------------------------------------------------------------------------

    def on_finished(self, seq: Sequence) -> None:
        """A request finished: hold its prompt blocks if a consumer will pull them. Called
        before the scheduler frees the request's blocks."""
        params = seq.kv_transfer_params
        if not self.config.is_producer or not params or not params.get("do_remote_decode"):
            return
        if seq.finish_reason is FinishReason.ABORT:
            return
        n = min(seq.num_prompt_tokens, seq.num_computed_tokens) // self.block_size
        n = min(n, len(seq.block_table))
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
        block_ids = list(seq.block_table[:n])
        tid = secrets.token_hex(16)
        if block_ids:
            for block_id in block_ids:
                self.pool.claim(block_id)
            self.holds[tid] = _Hold(block_ids, time.monotonic() + self.config.hold_timeout_s)
            self.connector.offer(tid, block_ids)
            self.stats.held_blocks += n
        host, port = self.connector.address()
        seq.kv_transfer_reply = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.connector.engine_id,
            "remote_host": host,
            "remote_port": port,
            "remote_request_id": tid,
            "remote_block_ids": block_ids,
            "remote_block_hashes": _chain_hashes(seq, self.block_size, n),
            "remote_num_tokens": seq.num_prompt_tokens,
        }

    def _end_holds(self) -> None:
        for tid in self.connector.released():
            hold = self.holds.get(tid)
            if hold is not None:
                hold.released = True
        now = time.monotonic()
        for tid, hold in list(self.holds.items()):
            if not hold.released and hold.deadline > now:
                continue
            if not self.connector.withdraw(tid):
                continue  # a read is in progress: next poll
            del self.holds[tid]
            self.pool.free(hold.block_ids[::-1])
            self.stats.held_blocks -= len(hold.block_ids)
            if hold.released:
                self.stats.holds_released += 1
            else:
                self.stats.hold_timeouts += 1
                log.warning(
                    "KV hold %s expired unpulled; %d blocks freed", tid, len(hold.block_ids)
                )

    # -- consumer --------------------------------------------------------------------------------

    def park(self, seq: Sequence) -> bool:
        """True when `seq` waits for a pull (the caller must not schedule it yet); False when it
        goes to the scheduler now. Malformed params raise ValueError before anything is held."""
        params = seq.kv_transfer_params
        if not self.config.is_consumer or not params or not params.get("do_remote_prefill"):
            return False
        remote, remote_hashes = _remote_params(params)
        bs = self.block_size
        # Contract 2: the prompt's last block is always computed here.
        usable = min(len(remote.block_ids), len(remote_hashes), (seq.num_prompt_tokens - 1) // bs)
        own = _chain_hashes(seq, bs, usable)
        same = next((i for i in range(usable) if own[i] != remote_hashes[i]), usable)
        usable = same
        prefix_ok = (
            self.block_manager.enable_prefix_caching and seq.sampling_params.prompt_logprobs is None
        )
        hits = self.block_manager.find_prefix_hit(seq)[:usable] if prefix_ok else []
        start = len(hits)
        need = usable - start
        idle_hits = sum(1 for b in hits if self.pool.blocks[b].ref_count == 0)
        busy = remote.transfer_id in self.pulls or remote.transfer_id in self.draining
        if not prefix_ok or need <= 0 or busy:
            self.stats.blocks_local_hit += start
            self.connector.release_remote(remote.host, remote.port, remote.transfer_id)
            return False
        if need + idle_hits > self.pool.num_free_blocks:
            log.warning("no room to pull %d KV blocks for %s; prefilling locally", need, seq)
            self.stats.fallbacks += 1
            self.connector.release_remote(remote.host, remote.port, remote.transfer_id)
            return False
        for block_id in hits:
            self.pool.claim(block_id)
        blocks = self.pool.allocate(need)
        wanted = RemoteBlocks(
            remote.transfer_id, remote.host, remote.port, remote.block_ids[start:usable]
        )
        self.pulls[remote.transfer_id] = _Pull(seq, wanted, hits, blocks, own[:usable], start)
        self.stats.blocks_local_hit += start
        self.stats.pulls_in_flight += 1
        self.connector.start_pull(wanted, blocks, self.config.pull_timeout_s)
        return True

    def _finish_pull(self, pull: _Pull, nbytes: int) -> None:
        """Place the pulled blocks (the transport wrote them) in the prefix cache; the caller
        then lets go of every block the pull held, and the scheduler's prefix lookup claims them
        again at once."""
        bs = self.block_size
        first = pull.start
        tokens = [
            pull.seq.token_ids[i * bs : (i + 1) * bs]
            for i in range(first, first + len(pull.blocks))
        ]
        self.pool.publish_hashes(
            pull.blocks,
            pull.hashes[first:],
            tokens,
            parent=pull.hashes[first - 1] if first else None,
        )
        self.stats.pulls_ok += 1
        self.stats.blocks_received += len(pull.blocks)
        self.stats.bytes_received += nbytes

    def _release_local(self, pull: _Pull) -> None:
        self.pool.free(pull.blocks[::-1] + pull.hits[::-1])
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

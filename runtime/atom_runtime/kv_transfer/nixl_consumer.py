"""The consumer's side of the NIXL connector: one-sided reads of held blocks straight into the
local blocks (no host bounce: a GPU cache is read GPU to GPU, over CUDA IPC on one node and RDMA
across nodes, as UCX finds the path).

A pull is a sealed `NixlPull` to the producer rank's control port; its sealed `NixlGrant` brings
the producer agent's metadata (loaded once per agent) and cache geometry. The control thread then
builds the descriptors of exactly the blocks and heads wanted (nixl_descs.py), waits for the
local blocks' fence (no step still writes them), and posts one READ whose completion notifies
the producer (a sealed note). It polls the read until NIXL reports it done or failed; a pull
cancelled or timed out while its read is in flight is aborted, and reported only once NIXL no
longer writes into its blocks. Every NIXL call runs on the control thread.

`NixlConsumer` is a part of `NixlConnector` (nixl.py).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import zmq

from atom_runtime.kv_transfer.base import PullResult
from atom_runtime.kv_transfer.nixl_descs import CacheGeometry, read_descriptors
from atom_runtime.kv_transfer.nixl_wire import PROTOCOL, NixlGrant, NixlPull, done_note
from atom_runtime.kv_transfer.pulls import PullBook, PullJob, report_pull
from atom_runtime.kv_transfer.wire import Release

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _ReadJob(PullJob):
    """A pull over NIXL: its posted READ and the descriptor handles it holds (`quiet`: cancelled
    before the read was posted)."""

    xfer: object = None  # the posted READ; from then on NIXL may write into the blocks
    handles: tuple = ()


class NixlConsumer(PullBook):
    job_type = _ReadJob

    def _init_consumer(self) -> None:
        self._pulls: dict[str, _ReadJob] = {}
        self._results: deque[PullResult] = deque()
        self._agent_at: dict[tuple[str, int], str] = {}  # producer address -> its agent, loaded

    # -- engine thread ---------------------------------------------------------------------------

    def cancel_pull(self, key: str) -> bool:
        with self._lock:
            job = self._pulls.get(key)
            if job is None:
                return True
            if job.xfer is None:
                job.quiet = True
                self._fail(job, "cancelled")
                return True
            if job.error is None:
                job.error = "cancelled"  # the control thread aborts the read, then reports
            return False

    def release_remote(self, host: str, port: int, transfer_id: str) -> None:
        self._command(("release", host, port, transfer_id))

    def _command_pull(self, key: str) -> None:
        self._command(("pull", key))

    # -- control thread --------------------------------------------------------------------------

    def _send_pull(self, key: str) -> None:
        with self._lock:
            job = self._pulls.get(key)
            if job is None:
                return
            r = job.remote
            msg = NixlPull(
                r.transfer_id,
                r.block_ids,
                self.kv.layout,
                PROTOCOL,
                max(0.001, job.deadline - time.monotonic()),
                heads=r.heads,
                agent=self.agent_name,
                agent_has=self._agent_at.get((r.host, r.port), ""),
            )
            self.seal.seal(msg)
            job.nonce = msg.nonce
        try:
            self._dealer(r.host, r.port).send(self._encoder.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            with self._lock:
                self._fail(job, "the producer is unreachable")

    def _send_release(self, host: str, port: int, transfer_id: str) -> None:
        msg = self.seal.seal(Release(transfer_id))
        try:
            self._dealer(host, port).send(self._encoder.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            pass  # the producer is gone; its hold times out on its side

    def _on_grant(self, grant: NixlGrant, address: tuple[str, int]) -> None:
        error = self.seal.check(grant)
        with self._lock:
            job = next(
                (
                    j
                    for j in self._pulls.values()
                    if j.remote.transfer_id == grant.transfer_id
                    and (j.remote.host, j.remote.port) == address
                ),
                None,
            )
            if job is None or job.xfer is not None or job.error is not None:
                return  # cancelled or timed out already: drop the late answer
            if error is None and grant.nonce != job.nonce and self.seal.key is not None:
                error = "the producer answered another pull"
            if error is None:
                error = grant.error
            if error is not None:
                self._fail(job, f"the producer's answer: {error}" if grant.error is None else error)
                return
        try:
            self._post(job, grant, address)
        except Exception as e:  # a bad grant or a NIXL error: this pull fails, no other
            log.warning("KV read from %s:%d not posted: %s", *address, e)
            with self._lock:
                self._fail(job, f"the read could not be posted: {e}")

    def _post(self, job: _ReadJob, grant: NixlGrant, address: tuple[str, int]) -> None:
        """Load the producer agent if new, build the read's descriptors and post it."""
        if self._agent_at.get(address) != grant.agent:
            if not grant.metadata:
                raise ValueError("the producer sent no agent metadata")
            name = self.agent.add_remote_agent(grant.metadata)
            name = name.decode() if isinstance(name, bytes) else name
            if name != grant.agent:
                raise ValueError(f"the producer's metadata names agent {name}, not {grant.agent}")
            self._agent_at[address] = name
        remote = CacheGeometry(
            list(grant.regions), grant.device, grant.memory, grant.block_bytes,
            grant.row_bytes, grant.head_bytes, grant.block_size,
        )  # fmt: skip
        r = job.remote
        local_descs, remote_descs = read_descriptors(
            self.geometry, remote, job.local_ids, r.block_ids, r.heads, r.local_heads
        )
        if job.fence is not None:
            job.fence.synchronize()  # no step still in flight touches these blocks
        agent = self.agent
        local = agent.prep_xfer_dlist("", local_descs, self.geometry.memory)
        far = agent.prep_xfer_dlist(grant.agent, remote_descs, remote.memory)
        count = _expanded(local_descs)
        index = list(range(count))
        note = done_note(self.seal.key, grant.ticket)
        xfer = agent.make_prepped_xfer("READ", local, index, far, index, note)
        with self._lock:
            job.handles = (local, far)
            if job.error is not None:  # cancelled meanwhile: never post
                self._release_handles(job, xfer)
                self._fail(job, job.error)
                return
            job.xfer = xfer
        state = agent.transfer(xfer)
        if state == "ERR":
            with self._lock:
                job.error = job.error or "NIXL failed the read"

    def _progress_reads(self) -> None:
        """Poll every posted read; report those that are over (their blocks untouched from
        here on)."""
        with self._lock:
            posted = [j for j in self._pulls.values() if j.xfer is not None and not j.reported]
        for job in posted:
            state = self.agent.check_xfer_state(job.xfer)
            if state == "PROC":
                if job.error is None or not self._abort(job):
                    continue
            elif state == "ERR" and job.error is None:
                job.error = "NIXL failed the read"
            with self._lock:
                self._release_handles(job, job.xfer)
                if job.error is not None:
                    self._fail(job, job.error)
                else:
                    self._settle(job)

    def _abort(self, job: _ReadJob) -> bool:
        """Try to stop a read still in flight; True when NIXL let go of it."""
        try:
            self.agent.release_xfer_handle(job.xfer)
        except Exception:
            return False  # it cannot be cancelled now: it ends on its own
        job.xfer = _Released()
        return True

    def _release_handles(self, job: _ReadJob, xfer) -> None:
        for handle in (xfer, *job.handles):
            if handle is not None and not isinstance(handle, _Released):
                try:
                    handle.release()
                except Exception:
                    log.debug("releasing a NIXL handle", exc_info=True)
        job.handles = ()

    def _expire_consumer(self, now: float) -> None:
        with self._lock:
            for job in [j for j in self._pulls.values() if j.deadline <= now and not j.error]:
                if job.xfer is None:
                    self._fail(job, "the producer's answer did not arrive in time")
                else:
                    job.error = "the read did not finish in time"  # aborted by the progress poll

    def _fail(self, job: _ReadJob, error: str) -> None:
        """Under the lock: a pull with nothing in flight fails (first error wins)."""
        job.error = job.error or error
        self._settle(job)

    def _settle(self, job: _ReadJob) -> None:
        """Under the lock: report a pull nothing writes into any more."""
        if job.reported:
            return
        if report_pull(job, self._pulls, self._results):
            self._wake.set()


class _Released:
    """Stands for a read NIXL has let go of (aborted): nothing to poll or release."""


def _expanded(descs) -> int:
    """How many descriptors NIXL makes of these rows (a strided row is `count` of them)."""
    return int(descs[:, 4].sum()) if descs.shape[1] == 5 else len(descs)

"""A hybrid model's recurrent state in prefill/decode disaggregation: it travels as a state
checkpoint (docs/state-checkpoints.md), an image kept in KV-pool blocks, so a transport moves it
exactly like KV blocks, rank by rank (each rank's image is its shard's, in its shard of the
blocks).

The consumer resumes a prompt at its last block boundary before the last token,
`R = (prompt_len - 1) // block_size * block_size` (contract 2: the last block is computed
there), so it needs the KV blocks before R and the state after exactly R tokens.

- Producer: a request for remote decode asks placement for a checkpoint at R (`mark`: a
  "handoff" boundary its prefill chunk is cut at); the usual checkpoint machinery copies the
  state there into lent blocks. When the request finishes, the agent holds that record with the
  prompt's blocks (`find`), pins it once READY (its copy rode the request's last batch), offers
  its units with the KV blocks and unpins it when the hold ends.
- Consumer: unless it has a READY checkpoint at R already, it stages a record for R (`stage`:
  blocks lent from its pool, not yet visible), pulls the producer's units into them with the KV
  blocks, and publishes it READY on success (`received`) or drops it on failure (`drop`). The
  scheduler then finds the KV prefix and the checkpoint at R like any other, and the restore,
  prefix reuse and eviction work as for checkpoints the engine made itself.
"""

from __future__ import annotations

from atom_runtime.state.checkpoint_record import CheckpointRef, CheckpointState, StagedCheckpoint
from atom_runtime.state.engine_checkpoints import EngineCheckpoints


def resume_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """Full blocks a consumer takes remotely: all but the one holding the prompt's last token."""
    return (num_prompt_tokens - 1) // block_size


class StateHandoff:
    def __init__(self, checkpoints: EngineCheckpoints) -> None:
        self.checkpoints = checkpoints
        self.store = checkpoints.store
        self.units_per_image = checkpoints.spec.units_per_image
        self.block_size = self.store.block_size

    # -- producer --------------------------------------------------------------------------------

    def mark(self, request_id: str, num_prompt_tokens: int) -> None:
        """Checkpoint this request's state where its consumer resumes."""
        position = resume_blocks(num_prompt_tokens, self.block_size) * self.block_size
        self.checkpoints.placement.hand_off(request_id, position)

    def find(self, prefix_hash: int) -> tuple[CheckpointRef, list[int]] | None:
        """The staged or READY checkpoint keyed by prefix_hash and its units, if any."""
        ref = self.store.find(prefix_hash)
        if ref is None:
            return None
        return ref, list(self.store.units_of(ref))

    def try_pin(self, ref: CheckpointRef) -> bool | None:
        """Pin ref once READY: True when pinned, False while its copy has not run, None when it
        is gone (evicted, cancelled)."""
        state = self.store.state_of(ref)
        if state is CheckpointState.READY:
            self.store.acquire(ref)
            return True
        return False if state is CheckpointState.COPYING else None

    def unpin(self, ref: CheckpointRef) -> None:
        self.store.release(ref)

    # -- consumer --------------------------------------------------------------------------------

    def has_ready(self, hashes: list[int], num_blocks: int) -> bool:
        """Whether a READY checkpoint sits exactly at num_blocks blocks of this prefix."""
        hit = self.store.lookup(hashes, num_blocks)
        return hit is not None and hit.num_tokens == num_blocks * self.block_size

    def stage(self, prefix_hash: int, num_blocks: int) -> StagedCheckpoint | None:
        """Blocks for the image the pull brings (None: no room, or being made already)."""
        return self.store.stage(prefix_hash, num_blocks * self.block_size)

    def received(self, ref: CheckpointRef) -> None:
        self.store.publish_received(ref)

    def drop(self, ref: CheckpointRef) -> None:
        self.store.cancel(ref)

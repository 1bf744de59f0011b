"""Where state checkpoints are placed (contract 6). Pure policy: it reads positions and counts,
and never touches the store, a tensor or a sequence object.

A hybrid model can resume a prefix only where a checkpoint of its recurrent state sits, so the
policy decides at which token positions a request's state is copied out:

- rungs: every `spacing` tokens (`--state-checkpoint-interval-tokens N`, snapped up to a whole
  number of hash blocks), during prefill and decode alike;
- the prompt-end anchor: the last block boundary of the prompt, where a follow-up turn that
  extends this conversation resumes;
- demand rungs: at admission, a KV prefix hit deeper than any checkpoint shows a prefix others
  share (a system prompt); the request stops there on its way, so the next one resumes there.

N > 0: all three. N = -1: no ladder, anchors and demand rungs only. N = 0: nothing.
Demand rungs can be switched off with `--no-state-checkpoint-demand` or
`ATOM_STATE_CHECKPOINT_DEMAND=0` (the flag wins over the variable).

A checkpoint of the state after position p needs a batch that ends the request exactly at p, so
`plan_prefill_chunk` cuts a prefill chunk short to land on the first boundary ahead of it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

from atom_runtime import envs
from atom_runtime.protocol.checkpoint_counters import StateCheckpointCounters

log = logging.getLogger(__name__)

DEMAND_ENV = envs.STATE_CHECKPOINT_DEMAND.name
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def resolve_demand(flag: bool | None, environ: Mapping[str, str] | None = None) -> bool:
    """Demand rungs on or off: the command-line flag when given, else the environment variable,
    else on."""
    if flag is not None:
        return bool(flag)
    raw = (os.environ if environ is None else environ).get(DEMAND_ENV, "").strip().lower()
    if raw == "":
        return True
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{DEMAND_ENV}: expected 1/0, true/false, yes/no or on/off, got {raw!r}")


def snap_interval(interval_tokens: int, block_size: int) -> int:
    """The rung spacing: N rounded up to whole hash blocks (a checkpoint is keyed by the hash of
    the block it ends; rounding up never stores more than the user budgeted). 0 and -1 pass."""
    if not isinstance(interval_tokens, int) or isinstance(interval_tokens, bool):
        raise ValueError(
            f"state_checkpoint_interval_tokens: must be an int, got {interval_tokens!r}"
        )
    if interval_tokens < -1:
        raise ValueError(
            "state_checkpoint_interval_tokens: must be -1, 0 or a positive token count, got "
            f"{interval_tokens}"
        )
    if interval_tokens <= 0:
        return interval_tokens
    spacing = -(-interval_tokens // block_size) * block_size
    if spacing != interval_tokens:
        log.warning(
            "--state-checkpoint-interval-tokens %d is not a multiple of the block size %d; "
            "checkpoints are placed every %d tokens",
            interval_tokens,
            block_size,
            spacing,
        )
    return spacing


@dataclass(frozen=True)
class ChunkPlan:
    """num_tokens to run for the sequence this step; boundary: the position whose state is to be
    checkpointed once this chunk has run (None: none); cut: the chunk was shortened for it."""

    num_tokens: int
    boundary: int | None = None
    reason: str | None = None  # "rung", "anchor", "demand" or "handoff"
    cut: bool = False


class CheckpointPlacement:
    def __init__(
        self,
        interval_tokens: int,
        block_size: int,
        demand: bool | None = None,
        *,
        decode_anchors: bool = True,
        counters: StateCheckpointCounters | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size: must be an int >= 1, got {block_size!r}")
        self.block_size = block_size
        self.interval_tokens = interval_tokens
        self.spacing = snap_interval(interval_tokens, block_size)
        self.enabled = self.spacing != 0
        self.demand_enabled = self.enabled and resolve_demand(demand, environ)
        self.decode_anchors = self.enabled and decode_anchors
        self.counters = counters if counters is not None else StateCheckpointCounters()
        # Per sequence: the one demand boundary it is heading for, and the deepest boundary it
        # placed (decode rungs keep their spacing from it).
        self._pending: dict[str, int] = {}
        # Per sequence: where a KV-transfer consumer will resume it (a prefill engine's request
        # for remote decode), kept apart from demands so neither displaces the other.
        self._handoff: dict[str, int] = {}
        self._last_placed: dict[str, int] = {}
        self._warned: set[str] = set()

    # -- positions -----------------------------------------------------------------------------

    def anchor(self, prompt_len: int) -> int | None:
        """The prompt-end anchor: the prompt's last block boundary (None if it has no full block
        or placement is off)."""
        if not self.enabled:
            return None
        pos = prompt_len // self.block_size * self.block_size
        return pos or None

    def next_rung(self, computed: int) -> int | None:
        """The first ladder rung strictly after computed (None without a ladder)."""
        if self.spacing <= 0:
            return None
        return (computed // self.spacing + 1) * self.spacing

    def pending(self, seq_id: str) -> int | None:
        return self._pending.get(seq_id)

    def hand_off(self, seq_id: str, position: int) -> None:
        """A prefill engine's request whose decode runs elsewhere: the consumer resumes at
        `position` (the prompt's last block boundary before its last token), so the state there
        is checkpointed, whatever the interval (placement must be on)."""
        if not isinstance(position, int) or position < 0 or position % self.block_size:
            raise ValueError(f"position: a block-aligned token count, got {position!r}")
        if self.enabled and position:
            self._handoff[seq_id] = position

    # -- admission -----------------------------------------------------------------------------

    def note_admission(self, seq_id: str, kv_hit_tokens: int, resume_tokens: int) -> bool:
        """At admission: the KV prefix hit covered kv_hit_tokens and the deepest checkpoint let
        the request resume at resume_tokens (<= the hit). Counts the realized and the lost hit
        and, when the hit went deeper than any checkpoint, records a demand rung there (the
        newer demand wins over an older one, which is counted as dropped). True if recorded."""
        for name, value in (("kv_hit_tokens", kv_hit_tokens), ("resume_tokens", resume_tokens)):
            if not isinstance(value, int) or value < 0 or value % self.block_size:
                raise ValueError(f"{name}: a block-aligned token count, got {value!r}")
        if resume_tokens > kv_hit_tokens:
            raise ValueError(
                f"resume_tokens: {resume_tokens} is deeper than the KV hit {kv_hit_tokens}"
            )
        self.counters.prefix_hit_tokens += resume_tokens
        self.counters.hit_lost_tokens += kv_hit_tokens - resume_tokens
        if kv_hit_tokens == resume_tokens:
            return False
        if not self.demand_enabled:
            self.counters.demands_declined += 1
            return False
        if self.spacing > 0 and kv_hit_tokens % self.spacing == 0:
            return False  # a ladder rung sits there already: nothing extra to ask for
        if self._pending.get(seq_id) is not None:
            self.counters.dropped += 1
        self._pending[seq_id] = kv_hit_tokens
        self.counters.demands_recorded += 1
        return True

    # -- prefill -------------------------------------------------------------------------------

    def plan_prefill_chunk(
        self,
        seq_id: str,
        computed: int,
        target_len: int,
        budget: int,
        prompt_len: int | None = None,
    ) -> ChunkPlan:
        """How many tokens to prefill now: min(target_len - computed, budget), cut short to end
        exactly on the first boundary ahead (rung, prompt-end anchor, this sequence's demand).
        target_len: the tokens to prefill (the prompt, or prompt + output on a recompute);
        prompt_len: where the anchor goes (default target_len). Never returns 0 tokens."""
        if not 0 <= computed < target_len:
            raise ValueError(f"computed: must be in [0, {target_len}), got {computed}")
        if budget < 1:
            raise ValueError(f"budget: must be >= 1, got {budget}")
        natural = min(target_len - computed, budget)
        if not self.enabled:
            return ChunkPlan(natural)
        prompt_len = target_len if prompt_len is None else prompt_len
        pending = self._pending.get(seq_id)
        if pending is not None and pending <= computed:
            # Resumed at or past it (or it was passed while unplaced): it can never be reached.
            del self._pending[seq_id]
            self.counters.dropped += 1
            pending = None
        candidates = []  # (position, reason), in the order a tie is attributed
        rung = self.next_rung(computed)
        if rung is not None and rung <= target_len:
            candidates.append((rung, "rung"))
        anchor = self.anchor(prompt_len)
        if anchor is not None and computed < anchor <= target_len:
            candidates.append((anchor, "anchor"))
        if pending is not None and pending <= target_len:
            candidates.append((pending, "demand"))
        handoff = self._handoff.get(seq_id)
        if handoff is not None and computed < handoff <= target_len:
            candidates.append((handoff, "handoff"))
        if not candidates:
            return ChunkPlan(natural)
        boundary = min(pos for pos, _ in candidates)
        if boundary > computed + natural:
            return ChunkPlan(natural)
        reason = next(r for pos, r in candidates if pos == boundary)
        if pending == boundary:
            del self._pending[seq_id]
        if handoff == boundary:
            del self._handoff[seq_id]
        num_tokens = boundary - computed
        cut = num_tokens < natural
        if cut:
            field = f"chunks_cut_{reason}"
            setattr(self.counters, field, getattr(self.counters, field) + 1)
        self._last_placed[seq_id] = max(self._last_placed.get(seq_id, 0), boundary)
        return ChunkPlan(num_tokens, boundary, reason, cut)

    # -- decode --------------------------------------------------------------------------------

    def decode_boundary(
        self, seq_id: str, computed: int, last_computed: int | None = None
    ) -> tuple[int, str] | None:
        """After a decode step leaves the sequence with computed tokens of state: the position to
        checkpoint and why, if any.

        "rung": a ladder rung at least one spacing past the last boundary this sequence placed
        (so an anchor just before a rung does not cost a second image). "decode_anchor": any
        other block boundary the generated text reaches, with placement on. Decode anchors roll:
        each one replaces the sequence's previous one (the scheduler supersedes it), so what
        stays when the request ends is the state where its text ended. The next turn of a
        conversation extends that text, so it resumes there rather than at the prompt's end,
        and its KV hit is no deeper than the checkpoint (no demand rung, no extra chunk).

        last_computed: the most tokens of state the sequence will ever have, when its end is
        known in advance (`Sequence.known_end`: EOS ignored, no stop condition, max_tokens set).
        A decode anchor with another block boundary still ahead of that end would only be
        superseded, so it is not placed: such a request copies its state out once, at its last
        boundary, instead of at every one (W1-shaped batches of the Qwen3.5-4B-shaped hybrid
        copied 51.5 MB a sequence every 16 tokens)."""
        if not self.enabled or computed % self.block_size:
            return None
        if (
            self.spacing > 0
            and computed % self.spacing == 0
            and computed - self._last_placed.get(seq_id, 0) >= self.spacing
        ):
            self._last_placed[seq_id] = computed
            return computed, "rung"
        if not self.decode_anchors:
            return None
        if last_computed is not None and computed + self.block_size <= last_computed:
            return None  # a later boundary before the known end supersedes it
        return computed, "decode_anchor"

    # -- lifetime ------------------------------------------------------------------------------

    def forget(self, seq_id: str) -> None:
        """The sequence finished, was aborted or preempted: its pending demand is dropped."""
        if self._pending.pop(seq_id, None) is not None:
            self.counters.dropped += 1
        self._handoff.pop(seq_id, None)
        self._last_placed.pop(seq_id, None)
        self._warned.discard(seq_id)

    def schedulability_warning(
        self, seq_id: str, num_tokens: int, num_pool_blocks: int, units_per_image: int
    ) -> str | None:
        """A request that cannot run under this policy is reported (once), not left waiting:
        None when it fits, else the message (also logged as a warning). A request needing more
        KV blocks than the pool has can never be scheduled; one that fits only without its own
        checkpoint image will run with its checkpoints dropped."""
        need = -(-num_tokens // self.block_size)
        if need > num_pool_blocks:
            message = (
                f"request {seq_id}: needs {need} KV blocks for {num_tokens} tokens, the pool "
                f"has {num_pool_blocks}; it can never be scheduled"
            )
        elif self.enabled and need + units_per_image > num_pool_blocks:
            message = (
                f"request {seq_id}: its {need} KV blocks leave no room for a state checkpoint "
                f"({units_per_image} blocks); it runs without checkpoints"
            )
        else:
            return None
        if seq_id not in self._warned:
            self._warned.add(seq_id)
            log.warning("%s", message)
        return message

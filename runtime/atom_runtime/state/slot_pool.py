"""State slots for hybrid models: where a resident request's recurrent state lives.

A Gated DeltaNet layer keeps, per request, a short causal-conv window and a [heads, k_dim, v_dim]
matrix that cannot be rebuilt from KV blocks. Every such layer holds one tensor per kind with a
row per slot (`StateTensors`); a request owns the same slot index in every layer (the model's
stateful layers form one group), so a slot is one integer the scheduler hands out:

- `StateSlotPool` is that allocator. It never touches tensors (the scheduler uses it as it uses
  the block pool). Each admitted request gets `slots_per_request` slots: the first is its
  committed state, the others are scratch for speculative work (any free slots, not
  necessarily adjacent).
- A reused slot is never read before it is written: a sequence's first chunk after admission
  (or after preemption by recompute) runs with `has_initial_state=False`, which makes the ops
  start from zeros and overwrite the slot whatever it held.

`plan_state_slots` splits a memory budget between slots and KV blocks; the model runner calls it
with what is left after the weights (GPU) or the configured host space (CPU).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from atom_runtime.core.sequence import Sequence

log = logging.getLogger(__name__)

# A slot plan gives the state at most this share of the budget when max_num_seqs slots do not
# fit; the KV cache keeps the rest.
STATE_SHARE = 0.5


HELD = "\x00held-for-a-checkpoint-copy"  # owner of a slot whose request left before its copy ran


class StateSlotPool:
    def __init__(self, num_slots: int, slots_per_request: int = 1) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots: must be >= 1, got {num_slots}")
        if not 1 <= slots_per_request <= num_slots:
            raise ValueError(
                f"slots_per_request: {slots_per_request} must be in [1, num_slots={num_slots}]"
            )
        self.num_slots = num_slots
        self.slots_per_request = slots_per_request
        # Lowest ids first: a small batch keeps touching the same few slots.
        self._free = list(range(num_slots - 1, -1, -1))
        self._owner: dict[int, str] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_in_use(self) -> int:
        return self.num_slots - len(self._free)

    def can_allocate(self) -> bool:
        return len(self._free) >= self.slots_per_request

    def allocate(self, seq: Sequence) -> bool:
        """Give seq its slots (slot 0: committed state). False, leaving no trace, when too few
        are free; a sequence that already holds slots keeps them."""
        if seq.state_slots:
            return True
        if not self.can_allocate():
            return False
        slots = [self._free.pop() for _ in range(self.slots_per_request)]
        for slot in slots:
            self._owner[slot] = seq.request_id
        seq.state_slots = slots
        return True

    def free(self, seq: Sequence, hold: frozenset[int] | set[int] = frozenset()) -> None:
        """Return seq's slots (finish, abort, preemption). Idempotent. Slots in `hold` leave seq
        but stay in use (a queued checkpoint copy still reads them): `give_back` frees them."""
        for slot in seq.state_slots:
            if self._owner.pop(slot, None) != seq.request_id:
                raise RuntimeError(f"state slot {slot} is not held by {seq.request_id!r}")
            if slot in hold:
                self._owner[slot] = HELD
            else:
                self._free.append(slot)
        seq.state_slots = []

    def give_back(self, slots) -> None:
        """Free slots `free` held for a checkpoint copy, once the copy has run."""
        for slot in slots:
            if self._owner.get(slot) != HELD:
                raise RuntimeError(f"state slot {slot} is not held for a checkpoint copy")
            del self._owner[slot]
            self._free.append(slot)

    @property
    def num_held(self) -> int:
        return sum(1 for owner in self._owner.values() if owner == HELD)


@dataclass(frozen=True)
class SlotPlan:
    num_slots: int
    num_blocks: int
    bytes_per_slot: int


def plan_state_slots(
    budget_bytes: float,
    bytes_per_slot: int,
    bytes_per_block: int,
    max_num_seqs: int,
    fixed_blocks: int | None = None,
) -> SlotPlan:
    """Split a memory budget between state slots and KV blocks. Slots first, one per possible
    running sequence, while they take at most `STATE_SHARE` of the budget (fewer otherwise; the
    engine then caps max_num_seqs); the KV cache gets the rest, or `fixed_blocks` when given
    (--num-gpu-blocks-override). A plan with no slot raises, naming the flag to raise."""
    if fixed_blocks is not None:
        room = budget_bytes - fixed_blocks * bytes_per_block
        num_slots = min(max_num_seqs, int(max(room, 0) // bytes_per_slot))
        num_blocks = fixed_blocks
    else:
        wanted = max_num_seqs * bytes_per_slot
        share = wanted if wanted <= budget_bytes * STATE_SHARE else budget_bytes * STATE_SHARE
        num_slots = min(max_num_seqs, int(max(share, 0) // bytes_per_slot))
        num_blocks = int(max(budget_bytes - num_slots * bytes_per_slot, 0) // bytes_per_block)
    if num_slots < 1:
        raise RuntimeError(
            f"no room for a single state slot ({bytes_per_slot / 2**20:.1f} MiB each) in "
            f"{max(budget_bytes, 0) / 2**30:.2f} GiB: raise --gpu-memory-utilization (on CPU: "
            "ATOM_CPU_KVCACHE_SPACE) or lower --max-num-batched-tokens"
        )
    return SlotPlan(num_slots, num_blocks, bytes_per_slot)


def ssm_state_dtype(name: str) -> torch.dtype:
    """The recurrent state's dtype for `--mamba-ssm-cache-dtype` `name`: auto is float32 (the
    delta rule accumulates over the whole sequence; docs/hybrid-models.md measures what a 16-bit
    state costs)."""
    dtypes = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16,
              "float16": torch.float16}  # fmt: skip
    if name not in dtypes:
        raise ValueError(
            f"mamba_ssm_cache_dtype: expected one of {', '.join(dtypes)}, got {name!r}"
        )
    return dtypes[name]


class StateTensors:
    """The device tensors behind the slots, bound into each stateful layer: per layer a conv
    state [slots, ...] in the model dtype and a recurrent state [slots, ...] in `ssm_dtype`
    (fp32 unless `--mamba-ssm-cache-dtype` says otherwise; the kernels compute in fp32 and
    round only what they store)."""

    def __init__(
        self,
        layers: list,
        dtype: torch.dtype,
        device: torch.device,
        ssm_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.layers = layers
        self.dtype = dtype
        self.device = device
        self.ssm_dtype = ssm_dtype

    def dtypes(self) -> list[torch.dtype]:
        """(conv state, recurrent state) dtypes, in the order of `state_shapes`."""
        return [self.dtype, self.ssm_dtype]

    @property
    def bytes_per_slot(self) -> int:
        total = 0
        for layer in self.layers:
            for shape, dtype in zip(layer.state_shapes(), self.dtypes(), strict=True):
                n = 1
                for s in shape:
                    n *= s
                total += n * torch.empty((), dtype=dtype).element_size()
        return total

    def allocate(self, num_slots: int) -> None:
        """Zero-filled (a fresh slot reads as zero state even to code that ignores
        has_initial_state); every layer's tensors get `num_slots` rows."""
        for layer in self.layers:
            conv, ssm = (
                torch.zeros((num_slots, *shape), dtype=dtype, device=self.device)
                for shape, dtype in zip(layer.state_shapes(), self.dtypes(), strict=True)
            )
            layer.conv_state, layer.ssm_state = conv, ssm

    def release(self) -> None:
        for layer in self.layers:
            layer.conv_state = layer.ssm_state = torch.empty(0)

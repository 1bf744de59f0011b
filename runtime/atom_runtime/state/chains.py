"""Conversation chains: which state checkpoints a newer one of the same conversation replaces.

A conversation moves forward turn by turn, and so do its useful checkpoints. Per conversation
the store keeps two: the latest prompt's anchor (what regenerating the last answer resumes
from) and the latest answer end (what the next turn resumes from). Everything older of the same
conversation is superseded once its successor is READY (until then the older one is still the
one a lookup finds):

- each decode anchor supersedes the request's previous decode anchor (a ladder rung does too,
  but is itself kept: the ladder is for sharing);
- a request that resumed from an answer end (a decode anchor of the previous turn) supersedes
  it, and the prompt anchor that turn kept, with its own prompt anchor.

Pure bookkeeping over `CheckpointRef`s; the scheduler tells it what it staged and resumed from,
and asks what to supersede when checkpoints are published.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from atom_runtime.state.checkpoint_record import CheckpointRef


class CheckpointChains:
    def __init__(self) -> None:
        # Per running request: its latest decode anchor, its prompt anchor, and what its prompt
        # anchor will supersede (the previous turn's answer end and prompt anchor).
        self._rolling: dict[str, CheckpointRef] = {}
        self._prompt: dict[str, CheckpointRef] = {}
        self._resumed: dict[str, list[CheckpointRef]] = {}
        # Per live decode anchor: the prompt anchor of the turn whose answer it ends.
        self._turn_prompt: dict[CheckpointRef, CheckpointRef] = {}
        # Staged (not yet READY) checkpoint -> the ones it supersedes once READY.
        self._pending: dict[CheckpointRef, list[CheckpointRef]] = {}

    def resumed(self, seq_id: str, ref: CheckpointRef, from_decode: bool) -> None:
        """seq_id resumes from ref; an answer end (from_decode) is the previous turn's."""
        if from_decode:
            older = [ref]
            if ref in self._turn_prompt:
                older.append(self._turn_prompt[ref])
            self._resumed[seq_id] = older

    def staged(self, seq_id: str, reason: str | None, ref: CheckpointRef) -> None:
        """seq_id staged ref for this reason ("anchor", "decode_anchor", "rung", "demand")."""
        if reason == "anchor":
            self._supersede(ref, self._resumed.pop(seq_id, []))
            self._prompt[seq_id] = ref
        elif reason in ("decode_anchor", "rung"):
            previous = self._rolling.pop(seq_id, None)
            self._supersede(ref, [previous] if previous is not None else [])
            if reason == "decode_anchor":
                self._rolling[seq_id] = ref
                if seq_id in self._prompt:
                    self._turn_prompt[ref] = self._prompt[seq_id]

    def published(self, refs: Iterable[CheckpointRef]) -> list[CheckpointRef]:
        """These became READY: the checkpoints they supersede."""
        out = []
        for ref in refs:
            for old in self._pending.pop(ref, ()):
                self._turn_prompt.pop(old, None)
                out.append(old)
        return out

    def forget(self, seq_id: str) -> None:
        """seq_id ended: its chain stays in the store; only the per-request state goes."""
        self._rolling.pop(seq_id, None)
        self._prompt.pop(seq_id, None)
        self._resumed.pop(seq_id, None)

    def prune(self, alive: Callable[[CheckpointRef], bool]) -> None:
        """Drop bookkeeping about checkpoints that are gone (evicted, dropped before READY)."""
        for ref in [r for r in self._pending if not alive(r)]:
            del self._pending[ref]
        for ref in [r for r in self._turn_prompt if not alive(r)]:
            del self._turn_prompt[ref]

    def _supersede(self, ref: CheckpointRef, older: list[CheckpointRef]) -> None:
        if older:
            self._pending[ref] = older

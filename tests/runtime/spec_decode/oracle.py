"""A drafter for tests that knows the answer: it proposes each sequence's true continuation (from
a non-speculative run of the same prompts) with chosen positions made wrong, so a test decides
exactly which drafts the verify step must accept and which it must reject."""

from __future__ import annotations

from collections.abc import Callable


class OracleDrafter:
    needs_hidden_states = False
    needs_step_chunks = False

    def __init__(
        self,
        truth: dict[tuple[int, ...], list[int]],
        k: int,
        wrong: Callable[[int, int], bool] = lambda step, pos: False,
    ) -> None:
        """truth: prompt ids -> the tokens the target generates after it. wrong(step, pos):
        whether draft `pos` of the drafter's `step`-th proposal (counted over all sequences)
        is made wrong."""
        self.truth = truth
        self.k = k
        self.wrong = wrong
        self.proposals = 0

    def propose(self, seqs, chunks=None, hidden=None) -> list[list[int]]:
        out = []
        for seq in seqs:
            if seq.num_computed_tokens != seq.num_tokens - 1:
                out.append([])
                continue
            done = seq.num_output_tokens
            drafts = list(self.truth[tuple(seq.prompt_token_ids.tolist())][done : done + self.k])
            for pos in range(len(drafts)):
                if self.wrong(self.proposals, pos):
                    drafts[pos] ^= 1  # another token, still in the vocabulary
            self.proposals += 1
            out.append(drafts)
        return out

    def attention_layers(self) -> list:
        return []


def install(llm, drafter) -> None:
    """Make `llm`'s engine draft with `drafter` (a speculative engine's runner)."""
    llm.engine.executor.drafter = drafter

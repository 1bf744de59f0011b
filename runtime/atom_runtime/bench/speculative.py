"""W7, speculative decoding, in `atom bench latency` (docs/benchmarks.md):

- with `--speculative-config`, W2's latency is time per *token* (a step emits one or more) and
  the acceptance counters are printed beside it;
- `--prompt-set copy`: copy-heavy prompts (repeat a text, edit a list, continue code that
  repeats itself) at batch 1, each run without and with speculation in the same call: decode
  tokens/s of both and the real acceptance (meant for real weights: the default model on CPU);
- `--spec-cost-sweep`: with dummy weights acceptance means nothing, so this measures costs
  only: a plain decode step, and for k = 1..K a verify step of k drafts and the drafter's
  proposal, then prints the per-token latency at acceptance 0.6 / 0.8 / 0.9 from the expected
  tokens per step (1 - a^(k+1)) / (1 - a), against the plain step.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

ACCEPTANCES = (0.6, 0.8, 0.9)

_TEXT = (
    "The old lighthouse stood at the edge of the cliff, its white paint peeling in long strips. "
    "Every night for ninety years its lamp had turned, sweeping the black water, warning ships "
    "away from the rocks below. The keeper, a quiet man named Elias, climbed the spiral stairs "
    "each evening at dusk, trimmed the wick, polished the lens and wrote the weather in a "
    "leather book."
)
_LIST = (
    "- The cat sleeps on the red sofa.\n- The cat eats fish every Friday.\n"
    "- The cat chases the neighbour's cat.\n- The cat hides under the bed during storms.\n"
    "- The cat watches birds from the kitchen window.\n"
)
_CODE = """class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()

    def peek(self):
        if not self.items:
            raise IndexError("peek at an empty stack")
        return self.items[-1]


class Queue:
    def __init__(self):
        self.items = []

    def push(self, item):
"""
# (what the user asks, whether the chat template wraps it)
COPY_PROMPTS = {
    "repeat": (f"Repeat the following text exactly, word for word.\n\n{_TEXT}", True),
    "edit": (f"Rewrite this list, replacing every 'cat' with 'dog'.\n\n{_LIST}", True),
    "code": (_CODE, False),
}


def add_arguments(lat: argparse.ArgumentParser) -> None:
    lat.add_argument(
        "--prompt-set",
        choices=["random", "copy"],
        default="random",
        help="random: W2's prompt; copy: copy-heavy prompts (repeat, edit, code), each run "
        "without and with --speculative-config (W7's real-acceptance run)",
    )
    lat.add_argument(
        "--spec-cost-sweep",
        action="store_true",
        help="with --speculative-config: time a verify step of k = 1..num_speculative_tokens "
        "drafts and a drafter proposal against a plain decode step, and print the per-token "
        "latency at acceptance 0.6/0.8/0.9 (W7; dummy weights are fine)",
    )


def run_copy_prompts(make_llm, args: argparse.Namespace, result: dict) -> None:
    """Each copy-heavy prompt at batch 1, plain then speculative, side by side (two engines:
    under a drifting load on a shared machine each pair is measured in the same minute):
    decode tok/s and acceptance."""
    from atom_runtime.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.output_len)
    engines = {"plain": make_llm(False), "spec": make_llm(True)}
    runs: dict[str, dict] = {}
    try:
        tok = engines["plain"].get_tokenizer()
        if tok is None:
            raise ValueError("--prompt-set copy: the model has no tokenizer")
        for name, (text, chat) in COPY_PROMPTS.items():
            ids = tok.encode_chat([{"role": "user", "content": text}]) if chat else tok.encode(text)
            entry = runs.setdefault(name, {"prompt_tokens": len(ids)})
            for label, llm in engines.items():
                stats = llm.engine.scheduler.spec_stats
                if stats is not None:
                    stats.reset()
                tokens, tok_s = decode_rate(llm, ids, params)
                entry[label] = {"output_tokens": tokens, "decode_tok_s": tok_s}
                if stats is not None:
                    entry[label]["acceptance"] = stats.summary()
    finally:
        for llm in engines.values():
            llm.shutdown()
    result["copy_prompts"] = runs
    for name, entry in runs.items():
        plain, spec = entry["plain"], entry["spec"]
        acc = spec.get("acceptance", {})
        print(
            f"atom  W7 {name:6s}: {plain['decode_tok_s']:.2f} -> {spec['decode_tok_s']:.2f} "
            f"tok/s ({spec['decode_tok_s'] / plain['decode_tok_s']:.2f}x), acceptance "
            f"{acc.get('acceptance_rate', 0):.2f}, {acc.get('mean_acceptance_length', 0):.2f} "
            f"tokens a step, {spec['output_tokens']} tokens"
        )


def report_acceptance(llm, result: dict) -> None:
    """With --speculative-config: the run's acceptance counters (vLLM's meanings) under
    `speculative` in the JSON, and one line of them."""
    spec = llm.engine.speculative
    if spec is None:
        return
    acc = result["speculative"] = llm.engine.scheduler.spec_stats.summary()
    print(
        f"atom  W7: {spec.method}, k = {spec.num_speculative_tokens}: acceptance "
        f"{acc['acceptance_rate']:.2f}, {acc['mean_acceptance_length']:.2f} tokens a step "
        f"({acc['num_accepted_tokens']} of {acc['num_draft_tokens']} drafts accepted, "
        f"{acc['num_emitted_tokens']} tokens emitted by verify steps)"
    )


def decode_rate(llm, prompt: list[int], params) -> tuple[int, float]:
    """One request alone: (output tokens, decode tokens per second from its first token on)."""
    from atom_runtime.protocol.engine_core import EngineRequest

    engine = llm.engine
    engine.add_request(EngineRequest(f"w7-{time.monotonic_ns()}", prompt, params))
    first = last = None
    tokens = 0
    while engine.has_unfinished_requests():
        out = engine.step()
        if out.token_ids:
            now = time.perf_counter()
            if first is None:
                first, tokens = now, 0
            else:
                tokens += len(out.token_ids)
            last = now
    total = tokens + 1
    return total, tokens / (last - first) if tokens else 0.0


def ms_per_token(llm, prompt: list[int], output_len: int) -> float:
    """W2 with speculation: steady-state time per token (a step may emit several)."""
    from atom_runtime.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    _, rate = decode_rate(llm, prompt, params)
    return 1000 / rate


class _FixedDrafter:
    """Exactly k drafts a step: the engine's own drafter's (so its cost is paid), padded or cut
    to k with random tokens (with dummy weights no draft is right anyway)."""

    needs_hidden_states = False
    needs_step_chunks = False

    def __init__(self, inner, k: int, vocab: int) -> None:
        self.inner, self.k, self.vocab = inner, k, vocab
        self.needs_hidden_states = inner.needs_hidden_states
        self.needs_step_chunks = inner.needs_step_chunks
        self.propose_s: list[float] = []
        self.rng = random.Random(0)
        if hasattr(inner, "k"):
            inner.k = k

    def propose(self, seqs, chunks=None, hidden=None):
        start = time.perf_counter()
        drafts = self.inner.propose(seqs, chunks, hidden) if self.k else [[] for _ in seqs]
        _sync()
        self.propose_s.append(time.perf_counter() - start)
        return [
            (d + [self.rng.randrange(self.vocab) for _ in range(self.k)])[: self.k] for d in drafts
        ]

    def attention_layers(self):
        return self.inner.attention_layers()


def run_cost_sweep(llm, prompt: list[int], args: argparse.Namespace, result: dict) -> None:
    """W7's step costs: plain, and verify + draft for k = 1..K; per-token latency table."""
    # Under tensor parallelism the drafter is rank 0's runner's (the executor's `runner`).
    runner = getattr(llm.engine.executor, "runner", llm.engine.executor)
    inner = runner.drafter
    k_max = llm.engine.speculative.num_speculative_tokens
    vocab = llm.engine.model_config.vocab_size
    rows = []
    try:
        for k in range(0, k_max + 1):
            fixed = _FixedDrafter(inner, k, vocab)
            runner.drafter = fixed
            step_s = _step_times(llm, prompt, args.output_len)
            draft = statistics.median(fixed.propose_s[2:]) if len(fixed.propose_s) > 2 else 0.0
            rows.append({"k": k, "step_ms": step_s * 1000, "draft_ms": draft * 1000})
    finally:
        runner.drafter = inner
        # The sweep's random drafts are all rejected: keep them out of the run's acceptance.
        llm.engine.scheduler.spec_stats.reset()
    plain = rows[0]["step_ms"]
    for row in rows:
        row["verify_ms"] = row["step_ms"] - row["draft_ms"]
        row["verify_over_plain"] = row["verify_ms"] / plain
        for a in ACCEPTANCES:
            tokens = (1 - a ** (row["k"] + 1)) / (1 - a)
            row[f"ms_per_token_a{a}"] = row["step_ms"] / tokens
            row[f"ratio_a{a}"] = row["step_ms"] / tokens / plain
    result["spec_cost_sweep"] = {"plain_step_ms": plain, "rows": rows}
    print(f"atom  W7 cost sweep ({llm.engine.speculative.method}); plain step {plain:.3f} ms")
    print("   k  step ms  verify ms  draft ms  verify/plain  " + "  ".join(
        f"ms/tok@{a} (x plain)" for a in ACCEPTANCES))  # fmt: skip
    for row in rows[1:]:
        cells = "  ".join(
            f"{row[f'ms_per_token_a{a}']:7.3f} ({row[f'ratio_a{a}']:.2f}x)" for a in ACCEPTANCES
        )
        print(
            f"  {row['k']:2d}  {row['step_ms']:7.3f}  {row['verify_ms']:9.3f}  "
            f"{row['draft_ms']:8.3f}  {row['verify_over_plain']:12.2f}  {cells}"
        )


def _step_times(llm, prompt: list[int], output_len: int) -> float:
    """Median wall time of the engine's steps after the first token (steady-state decode)."""
    from atom_runtime.protocol.engine_core import EngineRequest
    from atom_runtime.sampling_params import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    engine.add_request(EngineRequest(f"w7s-{time.monotonic_ns()}", prompt, params))
    stamps = []
    while engine.has_unfinished_requests():
        engine.step()
        _sync()
        stamps.append(time.perf_counter())
    steps = [b - a for a, b in zip(stamps[1:], stamps[2:], strict=False)]
    return statistics.median(steps[2:] or steps)


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()

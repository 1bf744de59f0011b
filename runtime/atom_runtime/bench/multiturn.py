"""`atom bench multiturn`: workload W5 of shared/BENCHMARKS.md, multi-turn prefix reuse.

    atom bench multiturn --load-format dummy --model benchmarks/configs/qwen3.5-4b

The trace: `--num-conversations` conversations of `--num-turns` turns. Every conversation opens
with one shared system prompt (`--system-prompt-len` tokens); each turn adds a user message of a
length uniform in `--user-len-range` and generates `--output-len` tokens (greedy, EOS ignored).
Turn t's prompt is the conversation so far as token ids (system prompt, every earlier user
message and every earlier generated token) plus turn t's user message. A conversation's turns run
in order, each submitted when the one before it finished; `--max-concurrency` conversations are
in flight at once, the next one starting when one ends. User token ids come from
`random.Random(--trace-seed)`, so every run of a sweep sees the same user messages.

One engine is built per configuration: prefix caching off (the baseline), then prefix caching on
with each `--state-checkpoint-interval-tokens` value. Per configuration it reports:

- realized prefix hit: the sum of the engine's per-request cached-token count (what the server
  reports as `usage.prompt_tokens_details.cached_tokens`; for a hybrid model the resumed length);
- ideal: what a full-attention model reuses on the same trace, replayed exactly (`ideal_prefix_hits`);
- hit lost to the checkpoint boundary: ideal minus realized, in tokens and as a share of the ideal;
- checkpoint memory as a share of the KV pool (peak and step mean), from the engine's
  `StateCheckpointCounters` when it has them, else "n/a";
- TTFT p50/p90 (submission to first token, measured by this driver) and prompt tokens computed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from atom_runtime.config import EngineConfig
from atom_runtime.engine_args import add_engine_arguments
from atom_runtime.protocol.block_hash import hash_token_blocks
from atom_runtime.system.flag_table import add_number_flags

DEFAULT_INTERVALS = "-1,512,2048,8192"


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `multiturn` under `atom bench`'s subcommands."""
    # "resolve": this command's --state-checkpoint-interval-tokens is a list to sweep and replaces
    # the engine's single-value flag of the same name.
    p = sub.add_parser(
        "multiturn",
        help="W5: multi-turn prefix reuse (realized vs ideal prefix hit, TTFT)",
        conflict_handler="resolve",
    )
    add_number_flags(p, num_conversations=64, num_turns=8, system_prompt_len=2048)
    p.add_argument(
        "--user-len-range",
        type=_parse_range,
        default=(100, 700),
        help="LO,HI: each user message's length, uniform in [LO, HI] (default 100,700)",
    )
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=16,
        help="conversations in flight at once (default 16)",
    )
    p.add_argument("--trace-seed", type=int, default=0, help="seed of the user messages")
    p.add_argument(
        "--baseline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run with prefix caching off (default on)",
    )
    p.add_argument("--output-json", default=None)
    add_engine_arguments(p)
    p.add_argument(
        "--state-checkpoint-interval-tokens",
        dest="intervals",
        type=_parse_intervals,
        default=_parse_intervals(DEFAULT_INTERVALS),
        help="comma-separated intervals to sweep, prefix caching on for each; write "
        f"--state-checkpoint-interval-tokens=-1,512 (with '=') (default {DEFAULT_INTERVALS})",
    )
    return p


def _parse_range(text: str) -> tuple[int, int]:
    parts = text.replace("-", ",").split(",")
    try:
        lo, hi = (int(x) for x in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO,HI (two integers), got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected 1 <= LO <= HI, got {text!r}")
    return lo, hi


def _parse_intervals(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    bad = [v for v in values if v < -1]
    if bad:
        raise argparse.ArgumentTypeError(f"intervals must be -1, 0 or positive, got {bad[0]}")
    return values


# -- the trace -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceSpec:
    num_conversations: int = 64
    num_turns: int = 8
    system_prompt_len: int = 2048
    user_len_range: tuple[int, int] = (100, 700)
    output_len: int = 128
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_conversations", "num_turns", "system_prompt_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        lo, hi = self.user_len_range
        if not 1 <= lo <= hi:
            raise ValueError(f"user_len_range: must be 1 <= lo <= hi, got {self.user_len_range}")

    @property
    def max_sequence_len(self) -> int:
        """Tokens of the longest possible last turn, its generated tokens included."""
        hi = self.user_len_range[1]
        return self.system_prompt_len + self.num_turns * (hi + self.output_len)


@dataclass(frozen=True)
class Trace:
    """The fixed part of the trace: the system prompt and every user message, by conversation
    and turn. The generated tokens come from the engine, so each run completes its own trace."""

    spec: TraceSpec
    system_prompt: list[int]
    user_messages: list[list[list[int]]]  # [conversation][turn] -> token ids


def make_trace(spec: TraceSpec, vocab_size: int) -> Trace:
    """Token ids in [100, 150000) modulo the vocabulary (as W1 draws them), Random(spec.seed),
    system prompt first, then conversation by conversation, turn by turn."""
    rng = random.Random(spec.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, 150000) % vocab_size for _ in range(n)]

    system = tokens(spec.system_prompt_len)
    lo, hi = spec.user_len_range
    users = [
        [tokens(rng.randint(lo, hi)) for _ in range(spec.num_turns)]
        for _ in range(spec.num_conversations)
    ]
    return Trace(spec, system, users)


# -- the ideal hit ---------------------------------------------------------------------------------


def ideal_prefix_hits(
    requests: Sequence[tuple[Sequence[int], Sequence[int]]], block_size: int
) -> list[int]:
    """Prompt tokens a full-attention model with an unbounded prefix cache reuses, per request.

    `requests` are (prompt, generated tokens) in submission order. Each prompt is looked up
    through the engine's block-hash prefix logic (contracts 1 and 2: the leading run of full
    blocks whose chained hash is cached; the block holding the prompt's last token is always
    recomputed). Then the request's computed tokens are cached: its prompt and every generated
    token but the last, which is sampled and never run through the model, so has no KV."""
    cache: set[int] = set()
    hits = []
    for prompt, output in requests:
        lookable = (len(prompt) - 1) // block_size * block_size
        n = 0
        for h in hash_token_blocks(prompt[:lookable], block_size):
            if h not in cache:
                break
            n += 1
        hits.append(n * block_size)
        computed = list(prompt) + list(output[:-1])
        cache.update(hash_token_blocks(computed, block_size))
    return hits


# -- one run ---------------------------------------------------------------------------------------


@dataclass
class TurnRecord:
    conversation: int
    turn: int
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    submitted: float = 0.0
    ttft_s: float | None = None


@dataclass
class CheckpointMemory:
    """Samples of the KV-pool share lent to state checkpoints, one per engine step."""

    peak: float = 0.0
    total: float = 0.0
    samples: int = 0

    def add(self, ratio: float) -> None:
        self.peak = max(self.peak, ratio)
        self.total += ratio
        self.samples += 1

    @property
    def mean(self) -> float:
        return self.total / self.samples if self.samples else 0.0


def checkpoint_counters(engine):
    """The engine's live `StateCheckpointCounters`, or None when it has none (a model without
    recurrent state, or a hybrid model run with checkpoints off). Looked for on the
    engine itself and in its stats message, so it does not depend on the field's name."""
    from atom_runtime.protocol.checkpoint_counters import StateCheckpointCounters

    for value in vars(engine).values():
        if isinstance(value, StateCheckpointCounters):
            return value
    stats = engine.stats()
    for name in getattr(stats, "__struct_fields__", ()):
        value = getattr(stats, name)
        if isinstance(value, StateCheckpointCounters):
            return value
    return None


def drive_trace(engine, trace: Trace, max_concurrency: int) -> tuple[list[TurnRecord], dict]:
    """Run the trace through an EngineCore: `max_concurrency` conversations in flight, each
    turn submitted once the conversation's previous turn finished. Returns the turns in
    submission order and the engine-side figures of the run."""
    from atom_runtime.protocol.engine_core import EngineRequest
    from atom_runtime.sampling_params import SamplingParams

    if max_concurrency < 1:
        raise ValueError(f"max_concurrency: must be >= 1, got {max_concurrency}")
    spec = trace.spec
    if spec.max_sequence_len > engine.max_model_len:
        raise ValueError(
            f"the trace's last turn may reach {spec.max_sequence_len} tokens, over the engine's "
            f"max_model_len {engine.max_model_len}; shorten the trace or raise --max-model-len"
        )
    params = SamplingParams(temperature=0, max_tokens=spec.output_len, ignore_eos=True)
    history = [list(trace.system_prompt) for _ in range(spec.num_conversations)]
    turns: list[TurnRecord] = []
    live: dict[str, TurnRecord] = {}
    not_started = deque(range(spec.num_conversations))
    memory = CheckpointMemory()
    counters = checkpoint_counters(engine)
    before = engine.stats()

    def submit(conv: int, turn: int) -> None:
        prompt = history[conv] + trace.user_messages[conv][turn]
        record = TurnRecord(conv, turn, prompt, submitted=time.perf_counter())
        rid = f"mt-{conv}-{turn}"
        engine.add_request(EngineRequest(rid, prompt, params))
        live[rid] = record
        turns.append(record)

    for _ in range(min(max_concurrency, spec.num_conversations)):
        submit(not_started.popleft(), 0)
    start = time.perf_counter()
    while live:
        if not engine.has_unfinished_requests():
            raise RuntimeError(f"engine went idle with {len(live)} turns unfinished")
        outputs = engine.step()
        now = time.perf_counter()
        if counters is not None and counters.pool_units:
            memory.add(counters.units_in_use / counters.pool_units)
        for rid, tokens in outputs.tokens_by_request().items():
            record = live.get(rid)
            if record is not None:
                if record.ttft_s is None:
                    record.ttft_s = now - record.submitted
                record.output_token_ids.extend(tokens)
        for out in outputs.updates:
            record = live.get(out.request_id)
            if record is None:
                continue
            record.num_cached_tokens = out.num_cached_tokens
            if out.finish_reason is None:
                continue
            del live[out.request_id]
            if out.finish_reason != "length" or len(record.output_token_ids) != spec.output_len:
                raise RuntimeError(
                    f"{out.request_id} finished ({out.finish_reason}) after "
                    f"{len(record.output_token_ids)} of {spec.output_len} tokens"
                )
            conv = record.conversation
            history[conv] = record.prompt_token_ids + record.output_token_ids
            if record.turn + 1 < spec.num_turns:
                submit(conv, record.turn + 1)
            elif not_started:
                submit(not_started.popleft(), 0)
    elapsed = time.perf_counter() - start
    return turns, _run_figures(engine, before, elapsed, counters, memory)


def _run_figures(engine, before, elapsed: float, counters, memory: CheckpointMemory) -> dict:
    """The engine-side figures of a trace run: what it computed and hit, since `before`."""
    after = engine.stats()
    figures = {
        "seconds": elapsed,
        "prompt_tokens_computed": after.prompt_tokens - before.prompt_tokens,
        "kv_prefix_hit_tokens": after.prefix_hits - before.prefix_hits,
        "prefix_queried_tokens": after.prefix_queries - before.prefix_queries,
        "num_preemptions": after.num_preemptions - before.num_preemptions,
        "kv_pool_blocks": after.num_blocks,
        # What the engine runs with: it switches prefix caching off for a hybrid model run with
        # state checkpoints off (interval 0), whatever the configuration asked for.
        "prefix_caching_effective": engine.scheduler.block_manager.enable_prefix_caching,
    }
    if counters is not None:
        figures["checkpoint_memory_peak"] = memory.peak
        figures["checkpoint_memory_mean"] = memory.mean
        figures["checkpoint_counters"] = dataclasses.asdict(counters)
    else:
        figures["checkpoint_memory_peak"] = figures["checkpoint_memory_mean"] = None
    return figures


def summarize(turns: list[TurnRecord], figures: dict, block_size: int, num_turns: int) -> dict:
    """The run's figures: realized vs ideal prefix hit, the lost hit (overall and by turn
    index), TTFT percentiles."""
    ideal = ideal_prefix_hits([(t.prompt_token_ids, t.output_token_ids) for t in turns], block_size)
    realized = [t.num_cached_tokens for t in turns]
    lost_by_turn = [0] * num_turns
    for t, i, r in zip(turns, ideal, realized, strict=True):
        lost_by_turn[t.turn] += i - r
    ideal_total, realized_total = sum(ideal), sum(realized)
    ttfts = sorted(t.ttft_s for t in turns)
    # Turns after the first: the ones that resume a conversation, where reuse pays most.
    followups = sorted(t.ttft_s for t in turns if t.turn > 0)
    prompt_total = sum(len(t.prompt_token_ids) for t in turns)
    return {
        "num_requests": len(turns),
        "prompt_tokens": prompt_total,
        "ideal_hit_tokens": ideal_total,
        "realized_hit_tokens": realized_total,
        "realized_over_ideal": realized_total / ideal_total if ideal_total else None,
        "lost_hit_tokens": ideal_total - realized_total,
        "lost_hit_share_of_ideal": (ideal_total - realized_total) / ideal_total
        if ideal_total
        else None,
        "lost_hit_tokens_by_turn": lost_by_turn,
        "ideal_share_of_prompt": ideal_total / prompt_total,
        "ttft_p50_s": _percentile(ttfts, 50),
        "ttft_p90_s": _percentile(ttfts, 90),
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_p50_followup_s": _percentile(followups, 50) if followups else None,
        **figures,
    }


def _percentile(values: list[float], p: float) -> float:
    import numpy as np

    return float(np.percentile(values, p))


def run_config(
    config: EngineConfig, trace_spec: TraceSpec, max_concurrency: int, label: str
) -> dict:
    """Build one engine for `config`, run the trace through it, shut it down."""
    from atom_runtime.llm import LLM

    kwargs = {k: v for k, v in vars(config).items() if k != "model"}
    llm = LLM(config.model, **kwargs)
    try:
        engine = llm.engine
        trace = make_trace(trace_spec, engine.model_config.vocab_size)
        turns, figures = drive_trace(engine, trace, max_concurrency)
        result = summarize(turns, figures, engine.block_size, trace_spec.num_turns)
    finally:
        llm.shutdown()
        del llm
        _free()
    result.update(
        label=label,
        enable_prefix_caching=config.enable_prefix_caching,
        state_checkpoint_interval_tokens=config.state_checkpoint_interval_tokens,
        state_checkpoint_demand=config.state_checkpoint_demand,
    )
    return result


def sweep_configs(
    base: EngineConfig, intervals: list[int], baseline: bool
) -> list[tuple[str, EngineConfig]]:
    """(label, config) per run: prefix caching off first, then on with each interval."""
    runs = []
    if baseline:
        runs.append(
            (
                "prefix off",
                dataclasses.replace(
                    base, enable_prefix_caching=False, state_checkpoint_interval_tokens=0
                ),
            )
        )
    for n in intervals:
        cfg = dataclasses.replace(
            base, enable_prefix_caching=True, state_checkpoint_interval_tokens=n
        )
        runs.append((f"interval {n}", cfg))
    return runs


def format_table(results: list[dict]) -> str:
    head = (
        f"{'run':<14} {'realized':>10} {'ideal':>10} {'real/ideal':>10} {'lost':>10} "
        f"{'lost %':>7} {'ckpt mem':>9} {'TTFT p50':>9} {'TTFT p90':>9} {'computed':>10}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        ratio = r["realized_over_ideal"]
        lost_share = r["lost_hit_share_of_ideal"]
        mem = r["checkpoint_memory_peak"]
        lines.append(
            f"{r['label']:<14} {r['realized_hit_tokens']:>10,} {r['ideal_hit_tokens']:>10,} "
            f"{'n/a' if ratio is None else f'{ratio:.1%}':>10} {r['lost_hit_tokens']:>10,} "
            f"{'n/a' if lost_share is None else f'{lost_share:.1%}':>7} "
            f"{'n/a' if mem is None else f'{mem:.1%}':>9} "
            f"{r['ttft_p50_s'] * 1000:>7.1f}ms {r['ttft_p90_s'] * 1000:>7.1f}ms "
            f"{r['prompt_tokens_computed']:>10,}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import torch

    base = EngineConfig.from_args(args)
    spec = TraceSpec(
        num_conversations=args.num_conversations,
        num_turns=args.num_turns,
        system_prompt_len=args.system_prompt_len,
        user_len_range=tuple(args.user_len_range),
        output_len=args.output_len,
        seed=args.trace_seed,
    )
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result: dict = {
        "workload": "multiturn",
        "model": base.model,
        "device": device,
        "date": time.strftime("%Y-%m-%d"),
        "argv": sys.argv[1:],
        "trace": dataclasses.asdict(spec),
        "max_concurrency": args.max_concurrency,
        "block_size": base.block_size,
        "runs": [],
    }
    print(
        f"W5 trace: {spec.num_conversations} conversations x {spec.num_turns} turns, system "
        f"prompt {spec.system_prompt_len}, user {spec.user_len_range[0]}-{spec.user_len_range[1]}"
        f", output {spec.output_len}, {args.max_concurrency} in flight, block {base.block_size}"
    )
    for label, cfg in sweep_configs(base, args.intervals, args.baseline):
        r = run_config(cfg, spec, args.max_concurrency, label)
        result["runs"].append(r)
        if r["prefix_caching_effective"] != cfg.enable_prefix_caching:
            print(f"{label}: the engine ran with prefix caching off", flush=True)
        print(
            f"{label}: realized {r['realized_hit_tokens']:,} of ideal {r['ideal_hit_tokens']:,} "
            f"tokens, TTFT p50 {r['ttft_p50_s'] * 1000:.1f} ms, {r['seconds']:.1f} s",
            flush=True,
        )
    print(format_table(result["runs"]))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def _free() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

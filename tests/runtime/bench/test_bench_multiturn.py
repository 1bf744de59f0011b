"""`atom bench multiturn` (W5): the trace, the ideal prefix hit, and realized == ideal on a dense
model, whose prefix cache reuses everything a full-attention model can."""

from __future__ import annotations

import argparse
import json
import random

import pytest

from atom_runtime.bench import cli as bench
from atom_runtime.bench import multiturn as bench_multiturn
from atom_runtime.bench.multiturn import TraceSpec, ideal_prefix_hits, make_trace

BLOCK = 16
# Small enough for CPU: a system prompt of 2 full blocks plus 8 tokens that share a block with
# the first user message, so only 32 of its tokens are a shareable prefix.
SPEC = TraceSpec(
    num_conversations=3,
    num_turns=3,
    system_prompt_len=40,
    user_len_range=(5, 30),
    output_len=4,
    seed=0,
)


def brute_force_ideal(requests: list[tuple[list[int], list[int]]], block: int) -> list[int]:
    """Per request: the longest common prefix with any earlier request's computed tokens
    (prompt + generated but the last), rounded down to whole blocks, and never reaching into the
    block that holds the prompt's last token. No hashing: plain token comparison."""
    hits = []
    for i, (prompt, _) in enumerate(requests):
        best = 0
        for earlier_prompt, earlier_out in requests[:i]:
            computed = earlier_prompt + earlier_out[:-1]
            n = 0
            while n < min(len(prompt), len(computed)) and prompt[n] == computed[n]:
                n += 1
            best = max(best, n)
        hits.append(min(best // block, (len(prompt) - 1) // block) * block)
    return hits


def test_ideal_prefix_hits_counts_whole_blocks_and_skips_the_last_generated_token():
    a_prompt = list(range(1, 11))  # 10 tokens
    a_out = [11, 12]  # 12 gets no KV: the last sampled token never runs through the model
    # 13 tokens: a computed 11 of them, 2 full blocks; block 3 (9..12) is not cached.
    b_prompt = a_prompt + a_out + [99]
    c_prompt = b_prompt[:12] + [5]  # b computed block 3, so c gets 3 blocks back
    e_prompt = a_prompt + [11, 77, 78, 79, 80]  # diverges inside block 3
    d_prompt = list(range(1, 9))  # 8 tokens: the block holding its last token is recomputed
    requests = [(a_prompt, a_out), (b_prompt, [5]), (c_prompt, [5])]
    requests += [(e_prompt, [5]), (d_prompt, [5])]
    assert ideal_prefix_hits(requests, block_size=4) == [0, 8, 12, 8, 4]


def test_ideal_prefix_hits_matches_brute_force_on_random_shared_prefixes():
    rng = random.Random(7)
    stems = [[rng.randrange(50) for _ in range(rng.randint(0, 60))] for _ in range(4)]
    requests = []
    for _ in range(40):
        prompt = list(rng.choice(stems))
        if requests and rng.random() < 0.5:  # a follow-up of an earlier request
            p, o = rng.choice(requests)
            prompt = p + o
        prompt += [rng.randrange(50) for _ in range(rng.randint(1, 20))]
        requests.append((prompt, [rng.randrange(50) for _ in range(rng.randint(1, 9))]))
    for block in (4, 8, 16):
        ideal = ideal_prefix_hits(requests, block)
        assert ideal == brute_force_ideal(requests, block)
        assert sum(ideal) > 0


def test_trace_is_fixed_by_its_seed_and_shapes_its_turns():
    trace = make_trace(SPEC, vocab_size=1000)
    assert trace == make_trace(SPEC, vocab_size=1000)
    other = make_trace(TraceSpec(**{**SPEC.__dict__, "seed": 1}), vocab_size=1000)
    assert other.system_prompt != trace.system_prompt
    assert len(trace.system_prompt) == 40
    assert len(trace.user_messages) == 3
    for conv in trace.user_messages:
        assert len(conv) == 3
        assert all(5 <= len(m) <= 30 for m in conv)
        assert all(0 <= t < 1000 for m in conv for t in m)
    assert SPEC.max_sequence_len == 40 + 3 * (30 + 4)


def test_bad_trace_settings_are_refused_with_the_field_named():
    with pytest.raises(ValueError, match="num_turns"):
        TraceSpec(num_turns=0)
    with pytest.raises(ValueError, match="user_len_range"):
        TraceSpec(user_len_range=(9, 3))
    with pytest.raises(argparse.ArgumentTypeError, match="intervals"):
        bench_multiturn._parse_intervals("-1,-5")


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(argv)


def test_multiturn_is_a_bench_subcommand_with_a_sweep_list():
    args = _parse(["multiturn"])
    assert args.workload == "multiturn"
    assert args.intervals == [-1, 512, 2048, 8192]
    assert (args.num_conversations, args.num_turns, args.system_prompt_len) == (64, 8, 2048)
    assert (args.user_len_range, args.output_len, args.baseline) == ((100, 700), 128, True)
    args = _parse(["multiturn", "--state-checkpoint-interval-tokens=-1,0", "--user-len-range=3-9"])
    assert args.intervals == [-1, 0]
    assert args.user_len_range == (3, 9)
    # The sweep list replaced the engine's single-value flag; the engine config keeps its default.
    default = bench_multiturn.EngineConfig().state_checkpoint_interval_tokens
    assert bench_multiturn.EngineConfig.from_args(args).state_checkpoint_interval_tokens == default


def test_dense_model_realizes_the_ideal_hit_exactly(tiny_models):
    """One conversation in flight at a time, a cache far larger than the trace: every request
    gets back exactly what a brute-force replay of the token ids says is reusable."""
    from atom_runtime.llm import LLM

    llm = LLM(str(tiny_models["llama"]), block_size=BLOCK, num_gpu_blocks_override=256)
    try:
        trace = make_trace(SPEC, llm.engine.model_config.vocab_size)
        turns, figures = bench_multiturn.drive_trace(llm.engine, trace, max_concurrency=1)
    finally:
        llm.shutdown()
    assert [(t.conversation, t.turn) for t in turns] == [(c, t) for c in range(3) for t in range(3)]
    for prev, cur in zip(turns, turns[1:], strict=False):
        if cur.turn:  # the conversation so far, then the new user message
            assert cur.prompt_token_ids == (
                prev.prompt_token_ids
                + prev.output_token_ids
                + trace.user_messages[cur.conversation][cur.turn]
            )
    assert turns[0].prompt_token_ids == trace.system_prompt + trace.user_messages[0][0]
    assert all(len(t.output_token_ids) == 4 for t in turns)
    requests = [(t.prompt_token_ids, t.output_token_ids) for t in turns]
    ideal = brute_force_ideal(requests, BLOCK)
    assert [t.num_cached_tokens for t in turns] == ideal
    # Non-trivial: later conversations get the system prompt's 2 blocks, later turns far more.
    assert ideal[3] == ideal[6] == 32
    assert all(ideal[c * 3 + t] > 32 for c in range(3) for t in (1, 2))
    assert figures["kv_prefix_hit_tokens"] == sum(ideal)
    assert figures["prompt_tokens_computed"] == sum(len(p) for p, _ in requests) - sum(ideal)
    assert figures["checkpoint_memory_peak"] is None  # a dense model holds no checkpoints


def test_cli_sweep_reports_the_baseline_and_interleaved_conversations(
    tiny_models, tmp_path, capsys
):
    """All three conversations in flight: their first turns are admitted in one step, before any
    system-prompt block exists, so the second and third miss its 2 blocks; every later turn
    gets its whole ideal hit. With prefix caching off nothing is reused."""
    out = tmp_path / "w5.json"
    args = _parse(
        [
            "multiturn",
            "--model",
            str(tiny_models["llama"]),
            "--block-size",
            str(BLOCK),
            "--num-gpu-blocks-override",
            "256",
            "--num-conversations=3",
            "--num-turns=3",
            "--system-prompt-len=40",
            "--user-len-range=5,30",
            "--output-len=4",
            "--max-concurrency=3",
            "--state-checkpoint-interval-tokens=-1",
            "--output-json",
            str(out),
        ]
    )
    assert bench.run(args) == 0
    result = json.loads(out.read_text())
    off, on = result["runs"]
    assert (off["label"], on["label"]) == ("prefix off", "interval -1")
    assert (off["enable_prefix_caching"], on["enable_prefix_caching"]) == (False, True)
    assert on["state_checkpoint_interval_tokens"] == -1
    assert off["realized_hit_tokens"] == 0
    assert (off["prefix_caching_effective"], on["prefix_caching_effective"]) == (False, True)
    assert off["prompt_tokens_computed"] == off["prompt_tokens"]
    assert off["lost_hit_tokens"] == off["ideal_hit_tokens"] > 0
    assert on["lost_hit_tokens_by_turn"] == [64, 0, 0]
    assert on["realized_hit_tokens"] == on["ideal_hit_tokens"] - 64
    assert on["prompt_tokens_computed"] == on["prompt_tokens"] - on["realized_hit_tokens"]
    for run in (off, on):
        assert run["num_requests"] == 9
        assert 0 < run["ttft_p50_s"] <= run["ttft_p90_s"]
        assert run["ttft_p50_followup_s"] > 0
        assert run["checkpoint_memory_peak"] is None
    table = capsys.readouterr().out
    assert "interval -1" in table and "prefix off" in table
    assert " n/a " in table  # no checkpoint memory on a dense model


def test_hybrid_model_runs_the_trace_and_never_beats_the_ideal(tiny_hybrid_models):
    """A hybrid (Gated DeltaNet) model: whatever it resumes from checkpoints (nothing while they
    are not wired into the engine), it is whole blocks, never more than the full-attention
    ideal, and every prompt token it did not resume it computed."""
    from atom_runtime.llm import LLM

    llm = LLM(
        str(tiny_hybrid_models["qwen3_5"]),
        block_size=BLOCK,
        num_gpu_blocks_override=256,
        state_checkpoint_interval_tokens=-1,
    )
    try:
        trace = make_trace(SPEC, llm.engine.model_config.vocab_size)
        turns, figures = bench_multiturn.drive_trace(llm.engine, trace, max_concurrency=2)
    finally:
        llm.shutdown()
    assert len(turns) == 9 and all(len(t.output_token_ids) == 4 for t in turns)
    ideal = brute_force_ideal([(t.prompt_token_ids, t.output_token_ids) for t in turns], BLOCK)
    realized = [t.num_cached_tokens for t in turns]
    assert sum(ideal) > 0
    assert all(0 <= r <= i and r % BLOCK == 0 for r, i in zip(realized, ideal, strict=True))
    prompt_tokens = sum(len(t.prompt_token_ids) for t in turns)
    assert figures["prompt_tokens_computed"] == prompt_tokens - sum(realized)
    summary = bench_multiturn.summarize(turns, figures, BLOCK, SPEC.num_turns)
    assert summary["lost_hit_tokens"] == sum(ideal) - sum(realized)
    peak = figures["checkpoint_memory_peak"]
    assert peak is None or 0 <= peak <= 1

"""`atom bench prefix`: W3, prefix reuse, with the offline engine.

A shared prefix (8,000 tokens), then requests that each add distinct tokens (64) and generate
(64). Time to first token is measured from `add_request` to the step that returns the request's
first token, with prefix caching on (the prefix computed once beforehand) and off, two ways:
one request at a time (`single`), and every request submitted at once (`at_once`). The figure
is the median TTFT cached over the median TTFT with caching off.

    atom bench prefix --load-format dummy --model benchmarks/configs/qwen3-0.6b
    atom bench prefix --model tiny-folder --prefix-len 2000 --num-requests 8   # CPU-sized

`--admission-only` skips the model and times what admitting one request over the cached prefix
costs the scheduler and block manager alone (hashing, prefix lookup, block claims): CPU work
that adds to every TTFT, with or without a GPU.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefix-len", type=int, default=8000, help="shared prefix tokens")
    p.add_argument("--suffix-len", type=int, default=64, help="distinct tokens per request")
    p.add_argument("--output-len", type=int, default=64, help="tokens generated per request")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument(
        "--at-once-requests",
        type=int,
        default=None,
        help="requests submitted together in the at_once mode (default: --num-requests; the "
        "issue's figure used 61)",
    )
    p.add_argument(
        "--modes",
        default="single,at_once",
        help="comma-separated: single (one request at a time), at_once (all submitted together)",
    )
    p.add_argument(
        "--caching",
        default="on,off",
        help="comma-separated: on, off (prefix caching of the engine under test)",
    )
    p.add_argument(
        "--admission-only",
        action="store_true",
        help="time the scheduler/block manager admitting a request over the cached prefix, "
        "without a model",
    )
    p.add_argument("--output-json", default=None)


def w3_prompts(
    prefix_len: int, suffix_len: int, num: int, vocab: int, seed: int
) -> tuple[list[int], list[list[int]]]:
    """The shared prefix and `num` distinct suffixes (token ids in [100, min(vocab, 150000)))."""
    rng = random.Random(seed)
    high = min(vocab, 150000)
    low = 100 if high > 101 else 0
    prefix = [rng.randrange(low, high) for _ in range(prefix_len)]
    suffixes = [[rng.randrange(low, high) for _ in range(suffix_len)] for _ in range(num)]
    return prefix, suffixes


def _median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1000


def ttfts(engine, prompts: list[list[int]], output_len: int, at_once: bool) -> list[float]:
    """Seconds from submitting each prompt to the step that returns its first token. `at_once`
    submits every prompt before the first step; otherwise each runs alone to completion."""
    from atom_runtime.protocol.engine_core import EngineRequest
    from atom_runtime.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    tag = time.monotonic_ns()
    out: dict[str, float] = {}

    def drive(submitted: dict[str, float]) -> None:
        while engine.has_unfinished_requests():
            for rid in engine.step().request_ids:
                if rid not in out:
                    out[rid] = time.perf_counter() - submitted[rid]

    groups = [list(enumerate(prompts))] if at_once else [[(i, p)] for i, p in enumerate(prompts)]
    order = []
    for group in groups:
        submitted = {}
        for i, prompt in group:
            rid = f"w3-{tag}-{i}"
            submitted[rid] = time.perf_counter()
            engine.add_request(EngineRequest(rid, prompt, params))
            order.append(rid)
        drive(submitted)
    return [out[rid] for rid in order]


def run_engine(args: argparse.Namespace, caching: bool) -> dict:
    """One engine, prefix caching on or off: warm up, then each mode over fresh suffixes."""
    from atom_runtime.config import EngineConfig
    from atom_runtime.llm import LLM

    config = EngineConfig.from_args(args)
    kwargs = {k: v for k, v in vars(config).items() if k != "model"}
    kwargs["enable_prefix_caching"] = caching
    llm = LLM(config.model, **kwargs)
    try:
        engine = llm.engine
        vocab = engine.model_config.vocab_size
        modes = _modes(args)
        prefix, suffixes = w3_prompts(
            args.prefix_len,
            args.suffix_len,
            args.num_requests * (len(modes) + 1),
            vocab,
            args.seed or 0,
        )
        need = args.prefix_len + args.suffix_len + args.output_len
        if need > engine.max_model_len:
            raise ValueError(
                f"--prefix-len + --suffix-len + --output-len = {need} tokens exceed the "
                f"engine's context of {engine.max_model_len}; pass smaller sizes or a larger "
                "--max-model-len"
            )
        # Warm-up: kernels, and (caching on) the prefix's blocks computed and published.
        ttfts(engine, [prefix + suffixes[0]], 1, at_once=False)
        result: dict = {"prefix_caching": caching}
        for k, mode in enumerate(modes):
            batch = suffixes[(k + 1) * args.num_requests : (k + 2) * args.num_requests]
            if mode == "at_once" and args.at_once_requests:
                batch = batch[: args.at_once_requests]
            times = ttfts(engine, [prefix + s for s in batch], args.output_len, mode == "at_once")
            result[mode] = {
                "num_requests": len(times),
                "ttft_p50_ms": _median_ms(times),
                "ttft_mean_ms": statistics.fmean(times) * 1000,
                "ttft_max_ms": max(times) * 1000,
                "ttfts_ms": [t * 1000 for t in times],
            }
            print(
                f"prefix caching {'on ' if caching else 'off'} {mode:<8} "
                f"TTFT p50 {result[mode]['ttft_p50_ms']:9.2f} ms over {len(times)} requests"
            )
        stats = engine.scheduler
        if stats.prefix_queries:
            result["prefix_hit_rate"] = stats.prefix_hits / stats.prefix_queries
        return result
    finally:
        llm.shutdown()


def _modes(args: argparse.Namespace) -> list[str]:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("single", "at_once")]
    if bad or not modes:
        raise ValueError(f"--modes: expected single and/or at_once, got {args.modes!r}")
    return modes


def measure_admission(
    prefix_len: int, suffix_len: int, block_size: int, repeats: int, seed: int = 0
) -> dict:
    """Milliseconds the scheduler and block manager spend admitting one request over a cached
    `prefix_len`-token prefix (schedule, commit, publish, finish), without a model: the
    Sequence is built outside the timed region; the rest is what every such admission pays."""
    from atom_runtime.core.block_manager import BlockManager
    from atom_runtime.core.block_pool import BlockPool
    from atom_runtime.core.scheduler import Scheduler
    from atom_runtime.core.sequence import Sequence
    from atom_runtime.sampling_params import SamplingParams

    blocks = 4 * (prefix_len + suffix_len) // block_size + 16
    manager = BlockManager(BlockPool(blocks, block_size), enable_prefix_caching=True)
    scheduler = Scheduler(
        manager,
        max_num_seqs=256,
        max_num_batched_tokens=prefix_len * 2 + 1024,
        max_model_len=prefix_len + suffix_len + 16,
        eos_token_ids=[],
    )
    prefix, suffixes = w3_prompts(prefix_len, suffix_len, repeats + 1, 150000, seed)
    params = SamplingParams(max_tokens=1)

    def admit(i: int) -> tuple[float, int]:
        seq = Sequence(f"a{i}", prefix + suffixes[i], params)
        scheduler.add(seq)
        start = time.perf_counter()
        batch = scheduler.schedule()
        scheduler.commit(batch, [])
        scheduler.update_from_output(batch, None)  # publishes the computed blocks
        scheduler.abort({seq.request_id})  # frees them, as a finish does
        return time.perf_counter() - start, batch.num_new_tokens[0]

    _, first = admit(0)  # computes and publishes the prefix
    times, news = zip(*(admit(i) for i in range(1, repeats + 1)), strict=True)
    return {
        "prefix_len": prefix_len,
        "suffix_len": suffix_len,
        "block_size": block_size,
        "repeats": repeats,
        "first_admission_new_tokens": first,
        "new_tokens_per_admission": news[0],
        "admission_ms_median": _median_ms(list(times)),
        "admission_ms_min": min(times) * 1000,
    }


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except ValueError as e:
        print(f"atom bench prefix: error: {e}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    for flag in ("prefix_len", "suffix_len", "output_len", "num_requests"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')}: must be >= 1")
    if args.at_once_requests is not None and not 1 <= args.at_once_requests <= args.num_requests:
        raise ValueError("--at-once-requests: must be in [1, --num-requests]")
    result: dict = {"workload": "W3", "argv": sys.argv[1:], "date": time.strftime("%Y-%m-%d")}
    if args.admission_only:
        adm = measure_admission(
            args.prefix_len, args.suffix_len, args.block_size, 200, args.seed or 0
        )
        result["admission"] = adm
        print(
            f"admission over a cached {adm['prefix_len']}-token prefix "
            f"(block {adm['block_size']}, {adm['new_tokens_per_admission']} new tokens): "
            f"median {adm['admission_ms_median']:.3f} ms, min {adm['admission_ms_min']:.3f} ms"
        )
    else:
        import torch

        result["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        for c in [c.strip() for c in args.caching.split(",") if c.strip()]:
            if c not in ("on", "off"):
                raise ValueError(f"--caching: expected on and/or off, got {args.caching!r}")
            result[f"caching_{c}"] = run_engine(args, c == "on")
        on, off = result.get("caching_on"), result.get("caching_off")
        if on and off:
            for mode in _modes(args):
                ratio = on[mode]["ttft_p50_ms"] / off[mode]["ttft_p50_ms"]
                result[f"{mode}_ratio"] = ratio
                print(f"W3 {mode}: cached/cold TTFT p50 = {ratio:.3f}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0

"""Where W3's time to first token goes: one request of a cached prefix + new tokens, max_tokens=1.

python benchmarks/trace_prefix.py --model benchmarks/configs/qwen3-0.6b [--out trace.json]

Builds the engine (dummy weights), computes and caches a shared prefix (--prefix-len, 8,000
tokens), then runs requests of prefix + --suffix-len (64) distinct new tokens, one at a time,
each to its first token. Printed: wall ms per request (add_request to the step that returns
its token, as `atom bench prefix` measures TTFT), the CPU time split by engine phase
(add_request, schedule, prepare inputs, forward, sample, commit, waiting for the GPU,
update_from_output, the rest of the step), and from a torch.profiler trace (CPU + CUDA
activities) of a few more requests: GPU kernel time per request and the kernels that take it.
The warm-up runs two cached requests first, so the kernel variants of the cached step are
compiled before anything is timed.

Runs on CPU too (no CUDA activity then, and the torch reference kernels in the forward), which
is how the engine-side phases are compared on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import random
import statistics
import time

import torch

from atom_runtime import LLM, SamplingParams
from atom_runtime.engine import core as engine_core
from atom_runtime.protocol.engine_core import EngineRequest

PHASES = (
    "add_request",
    "schedule",
    "prepare_inputs",
    "forward",
    "sample",
    "commit",
    "wait_gpu",
    "update_from_output",
)


class PhaseClock:
    """Wall time spent inside each wrapped engine method, summed per phase (nested phases are
    not double counted: prepare_inputs, forward and sample run inside execute, which is not
    wrapped)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self._undo: list[tuple[object, str, object]] = []

    def wrap(self, owner: object, name: str, phase: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - start

        self._undo.append((owner, name, original))
        setattr(owner, name, timed)

    def restore(self) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo.clear()


def instrument(engine) -> PhaseClock:
    clock = PhaseClock()
    runner = engine.executor
    clock.wrap(engine, "add_request", "add_request")
    clock.wrap(engine.scheduler, "schedule", "schedule")
    clock.wrap(runner, "prepare_inputs", "prepare_inputs")
    clock.wrap(runner, "forward", "forward")
    clock.wrap(runner, "sample", "sample")
    clock.wrap(engine.scheduler, "commit", "commit")
    clock.wrap(engine_core._InFlight, "wait", "wait_gpu")
    clock.wrap(engine.scheduler, "update_from_output", "update_from_output")
    return clock


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_request(engine, prompt: list[int], request_id: str) -> float:
    """Seconds from add_request to the step that returns the request's first token."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(EngineRequest(request_id, prompt, params))
    ttft = None
    while engine.has_unfinished_requests():
        out = engine.step()
        if ttft is None and request_id in out.request_ids:
            ttft = time.perf_counter() - start
    if ttft is None:
        raise RuntimeError(f"{request_id} finished without a token")
    return ttft


def trace(args: argparse.Namespace) -> dict:
    llm = LLM(args.model, load_format="dummy", max_model_len=args.max_model_len)
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)
    high = min(vocab, 150000)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, high) for _ in range(n)]

    prefix = tokens(args.prefix_len)
    try:
        run_request(engine, prefix + tokens(args.suffix_len), "warm-prefix")  # computes it
        for i in range(2):
            run_request(engine, prefix + tokens(args.suffix_len), f"warm-{i}")
        _sync()
        hits_before = engine.scheduler.prefix_hits

        clock = instrument(engine)
        walls, per_request, cpu = [], [], time.process_time()
        try:
            for i in range(args.requests):
                clock.seconds.clear()
                walls.append(run_request(engine, prefix + tokens(args.suffix_len), f"timed-{i}"))
                split = {p: clock.seconds[p] * 1e3 for p in PHASES}
                split["rest_of_step"] = walls[-1] * 1e3 - sum(split.values())
                per_request.append(split)
        finally:
            clock.restore()
        cpu = (time.process_time() - cpu) / args.requests
        n = args.requests
        # Median and minimum over the requests, phase by phase (the minimum is the steadier
        # figure on a shared machine).
        phases = {
            p: {
                "median": statistics.median(r[p] for r in per_request),
                "min": min(r[p] for r in per_request),
            }
            for p in per_request[0]
        }
        cached = (engine.scheduler.prefix_hits - hits_before) / n

        acts = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=acts) as prof:
            for i in range(args.trace_requests):
                run_request(engine, prefix + tokens(args.suffix_len), f"traced-{i}")
            _sync()
    finally:
        llm.shutdown()

    kernels = collections.defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels[ev.name[:90]]
            k[0] += 1
            k[1] += ev.device_time
    m = args.trace_requests
    kernel_us = sum(v[1] for v in kernels.values()) / m
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:25]
    walls_ms = [w * 1e3 for w in walls]
    print(
        f"\n{args.model}: {args.prefix_len}-token cached prefix + {args.suffix_len} new tokens "
        f"(prefix hit {cached:.0f} tokens), max_tokens=1, {n} requests one at a time"
    )
    print(
        f"  wall per request: median {sorted(walls_ms)[n // 2]:.3f} ms, min {min(walls_ms):.3f}"
        f" ms; process CPU {cpu * 1e3:.3f} ms per request"
    )
    print("  phases (ms per request, wall time inside each; median, min):")
    for phase, ms in phases.items():
        print(f"    {phase:<20} {ms['median']:8.3f} {ms['min']:8.3f}")
    if kernels:
        print(f"  GPU kernels: {kernel_us:.1f} us per request (traced {m})")
        for name, (count, us) in top:
            print(f"  {us / m:8.1f} us/req  {count / m:6.1f}/req  {us / count:7.2f} us  {name}")
    return {
        "model": args.model,
        "prefix_len": args.prefix_len,
        "suffix_len": args.suffix_len,
        "prefix_hit_tokens": cached,
        "wall_ms": walls_ms,
        "wall_ms_median": sorted(walls_ms)[n // 2],
        "process_cpu_ms_per_request": cpu * 1e3,
        "phases_ms": phases,
        "kernel_us_per_request": kernel_us,
        "top_kernels": [(name, c / m, us / m) for name, (c, us) in top],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prefix-len", type=int, default=8000)
    ap.add_argument("--suffix-len", type=int, default=64)
    ap.add_argument("--requests", type=int, default=20, help="timed requests")
    ap.add_argument("--trace-requests", type=int, default=3, help="requests under the profiler")
    ap.add_argument("--max-model-len", type=int, default=16384)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (CPU runs)")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    result = trace(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()

"""Where one fresh prompt's prefill step goes, kernel by kernel, with the dense prefill path on
and off (the same engine, the layers' flag flipped): wall time, GPU kernel time and the kernels
that take it, per prompt length; and where the host's time goes (each engine step's wall time,
the Python functions that take it under cProfile).

    python benchmarks/trace_fresh_prefill.py --model benchmarks/configs/qwen3-0.6b \\
        --lengths 5003,8192

Eager, dummy weights, prefix caching off, max_tokens=1 (the step is the prompt's prefill and
its first token). Written to explain an engine measurement the kernel timings do not: on an
H200 a 5,003-token prompt of Qwen3-0.6B took 26.7 ms with the dense path against 19.5 without,
though the dense kernel alone is 7% faster there (docs/kernels.md).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import pstats
import statistics
import time

import torch
from prefill_dense_bench import fresh_prompt_engine

from atom_runtime import SamplingParams
from atom_runtime.protocol.engine_core import EngineRequest


def one_prompt(engine, prompt: list[int], params: SamplingParams, steps: list | None = None):
    """Milliseconds from adding the prompt to its first token, synchronized; each engine step's
    wall milliseconds appended to `steps`."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.add_request(EngineRequest(f"p{time.monotonic_ns()}", prompt, params))
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        if steps is not None:
            steps.append(round((time.perf_counter() - t0) * 1e3, 2))
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def host_profile(engine, prompt: list[int], params: SamplingParams, top: int) -> list[str]:
    """The Python functions one prompt's run spends its host time in (cProfile, by own time)."""
    prof = cProfile.Profile()
    prof.enable()
    one_prompt(engine, prompt, params)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return [line for line in buf.getvalue().splitlines() if line.strip()][-top - 1 :]


# The caching allocator's counters that say whether a step went back to the driver for memory
# (a nearly full GPU: each of those can free cached blocks and synchronize).
ALLOCATOR_COUNTERS = (
    "num_alloc_retries",
    "num_device_alloc",
    "num_device_free",
    "num_sync_all_streams",
)
# Runtime calls that stall the host or the device.
STALLS = ("cudaMalloc", "cudaFree", "cudaDeviceSynchronize", "cudaStreamSynchronize")


def trace(engine, prompt: list[int], params: SamplingParams, top: int) -> dict:
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    before = torch.cuda.memory_stats()
    with torch.profiler.profile(activities=acts) as prof:
        wall = one_prompt(engine, prompt, params)
    after = torch.cuda.memory_stats()
    kernels = collections.defaultdict(lambda: [0, 0.0])
    stalls = collections.defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels[ev.name[:90]]
            k[0] += 1
            k[1] += ev.device_time
        elif ev.name.startswith(STALLS):
            k = stalls[ev.name]
            k[0] += 1
            k[1] += ev.cpu_time_total
    gpu_us = sum(v[1] for v in kernels.values())
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "wall_ms": wall,
        "gpu_ms": gpu_us / 1e3,
        "kernels": [(name, count, round(us, 1)) for name, (count, us) in ranked],
        "stalls": {name: (count, round(us, 1)) for name, (count, us) in stalls.items()},
        "allocator": {c: after.get(c, 0) - before.get(c, 0) for c in ALLOCATOR_COUNTERS},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--lengths", default="5003,8192")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--runs", type=int, default=6, help="untraced runs per setting")
    ap.add_argument("--out")
    args = ap.parse_args()
    llm, layers, supported, make_prompt = fresh_prompt_engine(args.model)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    result = {}
    for n in (int(x) for x in args.lengths.split(",")):
        prompt = make_prompt(n)
        for dense in (True, False) if supported else (False,):
            for layer in layers:
                layer.dense_prefill = dense
            steps = [[] for _ in range(args.runs)]
            walls = [one_prompt(engine, prompt, params, steps[i]) for i in range(args.runs)]
            best = min(walls)
            got = trace(engine, prompt, params, args.top)
            got["best_untraced_ms"] = best
            got["untraced_ms"] = [round(w, 2) for w in walls]
            got["step_ms"] = steps
            got["host_profile"] = host_profile(engine, prompt, params, args.top)
            result[f"{n} dense {'on' if dense else 'off'}"] = got
            print(f"\n{n} tokens, dense {'on' if dense else 'off'}: best {best:.2f} ms untraced "
                  f"(median {statistics.median(walls):.2f}); traced wall {got['wall_ms']:.2f} ms, "
                  f"GPU kernels {got['gpu_ms']:.2f} ms", flush=True)  # fmt: skip
            print(f"  untraced runs {got['untraced_ms']}; their engine steps (ms) {steps}")
            print(f"  allocator {got['allocator']}; runtime stalls (calls, us) {got['stalls']}")
            for name, count, us in got["kernels"]:
                print(f"  {us / 1e3:8.3f} ms  {count:4d}x  {name}", flush=True)
            print("  host (cProfile, own time):")
            for line in got["host_profile"]:
                print(f"    {line[:200]}", flush=True)
    llm.shutdown()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

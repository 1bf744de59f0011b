"""Where a batch-1 decode step's GPU time goes, kernel by kernel, plus M = 1 projections alone.

python benchmarks/trace_decode.py --model benchmarks/configs/qwen3-0.6b [--eager]

Runs the engine (dummy weights, one 128-token prompt) and traces ten decode steps with
torch.profiler: wall time per step, GPU kernel time per step, and the kernels that take it.
The projections alone, cuBLAS against the Triton GEMV: benchmarks/gemv_sweep.py.
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import torch

from atom_runtime import LLM, SamplingParams
from atom_runtime.protocol.engine_core import EngineRequest


def trace_engine(model: str, steps: int, eager: bool) -> dict:
    llm = LLM(model, load_format="dummy", enforce_eager=eager, max_model_len=4096)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps + 40, ignore_eos=True)
    engine.add_request(EngineRequest("p0", [100] * 128, params))
    for _ in range(20):
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / steps
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    kernels = collections.defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels[ev.name[:90]]
            k[0] += 1
            k[1] += ev.device_time
    total = sum(v[1] for v in kernels.values()) / steps
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:25]
    print(
        f"\n{model} eager={eager}: wall {wall * 1e3:.3f} ms/step, GPU kernels {total:.1f} us/step"
    )
    for name, (count, us) in top:
        print(
            f"  {us / steps:8.1f} us/step  {count / steps:6.1f}/step  {us / count:7.2f} us  {name}"
        )
    del llm, engine
    torch.cuda.empty_cache()
    return {
        "wall_ms": wall * 1e3,
        "kernel_us": total,
        "top": [(n, c / steps, us / steps) for n, (c, us) in top],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--eager", action="store_true", help="also trace without CUDA graphs")
    ap.add_argument("--out")
    args = ap.parse_args()
    result = {"graph": trace_engine(args.model, args.steps, eager=False)}
    if args.eager:
        result["eager"] = trace_engine(args.model, args.steps, eager=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()

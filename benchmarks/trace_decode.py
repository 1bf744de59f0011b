"""Where a batch-1 decode step's GPU time goes, kernel by kernel, plus M = 1 projections alone.

python benchmarks/trace_decode.py --model benchmarks/configs/qwen3-0.6b [--gemv]

Part 1 runs the engine (dummy weights, one 128-token prompt) and traces ten decode steps with
torch.profiler: wall time per step, GPU kernel time per step, and the kernels that take it.
Part 2 (--gemv) times each projection of the model at M = 1 inside a CUDA graph: cuBLAS
(F.linear) against the Triton GEMV of atom_kernels, as achieved bandwidth.
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import torch

from atom_runtime import LLM, SamplingParams
from atom_runtime.engine.messages import EngineRequest


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


def time_graph(fn, reps: int = 20, iters: int = 20) -> float:
    """Microseconds per call of fn, replayed inside one CUDA graph of `reps` calls."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / (iters * reps) * 1e6


def gemv_table(model: str) -> list[dict]:
    from atom_kernels import ops
    from atom_kernels.gemv import gemv

    cfg = json.load(open(f"{model}/config.json"))
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {
        "qkv": (q + 2 * kv, h),
        "o": (h, q),
        "gate_up": (2 * inter, h),
        "down": (h, inter),
        "lm_head": (cfg["vocab_size"], h),
    }
    rows = []
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ref = torch.nn.functional.linear(x, w)
        got = ops.linear_small_m(x, w)
        err = (got.float() - ref.float()).abs().max().item()
        mb = n * k * 2 / 1e6
        t_cublas = time_graph(lambda: torch.nn.functional.linear(x, w))  # noqa: B023
        t_triton = time_graph(lambda: ops.linear_small_m(x, w))  # noqa: B023
        sweep = {}
        for bn in (8, 16, 32):
            for bk in (256, 512, 1024):
                for sp in (1, 2, 4, 8):
                    for nw in (4, 8):

                        def fn(bn=bn, bk=bk, sp=sp, nw=nw, x=x, w=w):
                            return gemv(x, w, block_n=bn, block_k=bk, split=sp, num_warps=nw)

                        sweep[f"bn{bn} bk{bk} s{sp} w{nw}"] = time_graph(fn, reps=10, iters=10)
        best = sorted(sweep.items(), key=lambda kv: kv[1])[:3]
        row = {
            "proj": name,
            "n": n,
            "k": k,
            "MB": round(mb, 1),
            "cublas_us": round(t_cublas, 2),
            "cublas_TBps": round(mb / t_cublas, 2),
            "triton_us": round(t_triton, 2),
            "triton_TBps": round(mb / t_triton, 2),
            "max_abs_err": err,
            "sweep_best": [(c, round(t, 2), round(mb / t, 2)) for c, t in best],
        }
        print(row)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--eager", action="store_true", help="also trace without CUDA graphs")
    ap.add_argument("--gemv", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    result = {"graph": trace_engine(args.model, args.steps, eager=False)}
    if args.eager:
        result["eager"] = trace_engine(args.model, args.steps, eager=True)
    if args.gemv:
        result["gemv"] = gemv_table(args.model)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()

"""Where a W1 decode step's time goes at full batch, kernel group by kernel group, for each way of
running the GDN decode: torch.profiler over steady-state steps of W1's 256 requests.

    python benchmarks/trace_w1_step.py --model benchmarks/configs/qwen3.5-4b \
        --variants split,auto,auto:bfloat16 --w1 --out trace_w1.json

Each variant is `PATH[:STATE_DTYPE]`: ATOM_GDN_DECODE (split: gdn_decode.py's kernel, the path
before the wide one; auto: the default, the wide kernel where the batch fills the GPU; wide)
and `--mamba-ssm-cache-dtype` (float32 unless given), each in its own process (the switch is
read at import). With `--w1` a variant's engine first runs W1 itself (`atom bench
throughput`'s run: the same prompts, warm-up and timing, its bound printed), so one start-up
gives the figure and the trace. Then it submits 256 W1-shaped requests (other prompts, so
nothing is cached; dummy weights), steps until every one has its first token (the prefill
phase, timed: W1's bound leaves it out), runs `--decode-steps` decode steps to reach W1's
middle contexts, times `--timed-steps` more, then profiles `--steps`. Per variant it prints
and writes:

- W1's tok/s and bound (with `--w1`), and the GDN decode launch the start-up timing chose;

- wall ms a decode step (with the batch and mean context), GPU kernel ms a step and the GPU's
  idle share (wall minus kernels: launch gaps and host time the GPU waits for);
- host ms a step: the engine's CPU time outside waits on the GPU (CUDA syncs);
- each group's kernel time a step and share (GDN decode, conv, gated norm, GDN prefill,
  attention, GEMMs, MoE, RMSNorm, state-checkpoint copies, sampling, copies, other), and the
  GDN decode kernel's GB/s over the state bytes it must move;
- the 25 largest kernels.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import time

GROUPS = (  # first match wins
    ("gdn_decode", r"_gdn_decode_(wide_)?kernel"),
    ("gdn_prefill", r"_gdn_(chunk|recurrent|gating)_kernel|chunk_gated_delta|chunk_fwd"),
    ("conv1d", r"_conv1d"),
    ("gated_norm", r"_gated_rms_norm"),
    (
        "attention",
        r"_decode_(split|merge)|_prefill(_merge)?_kernel|_qk_prep|_rotary|"
        r"_store_kvcache|_sigmoid_gate|flash|fmha|cudnn|attention",
    ),  # fmt: skip
    ("moe", r"moe"),
    ("gemm", r"gemm|gemv|nvjet|cutlass|xmma|Kernel2|cublas"),
    ("rms_norm", r"_rms_norm"),
    ("state_checkpoint_copy", r"_state_copy"),
    ("sampling", r"argmax|softmax|topk|sort|sampl|multinomial|exponential|reduce_kernel"),
    ("copies", r"[Mm]emcpy|[Mm]emset|copy|fill|[Cc]at|index|gather|scatter|elementwise"),
)
SYNCS = ("cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize")


def group_of(kernel: str) -> str:
    for name, pattern in GROUPS:
        if re.search(pattern, kernel):
            return name
    return "other"


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_variant(args: argparse.Namespace) -> dict:
    """In this process: the engine with the variant's settings, traced."""
    import torch

    from atom_runtime import LLM
    from atom_runtime.bench.cli import run_throughput, w1_prompts
    from atom_runtime.protocol.engine_core import EngineRequest
    from atom_runtime.sampling_params import SamplingParams

    llm = LLM(
        args.model,
        load_format="dummy",
        max_num_seqs=args.batch,
        mamba_ssm_cache_dtype=args.state_dtype,
    )
    engine = llm.engine
    w1: dict = {}
    if args.w1:  # `atom bench throughput`'s own W1 run and bound, in this engine
        w1_args = argparse.Namespace(num_prompts=args.w1_prompts, input_len_min=100,
                                     input_len_max=1024, output_len=args.w1_output_len,
                                     peer_num_prompts=None, peer_batch_size=64)  # fmt: skip
        run_throughput(llm, w1_args, w1)
    vocab = engine.model_config.vocab_size
    # Other prompts than W1's (seed 1): none of them finds its prefix cached by the W1 run.
    prompts = [[t % vocab for t in p] for p in w1_prompts(args.batch, 100, 1024, seed=1)]
    total = args.decode_steps + args.timed_steps + args.steps + 8
    params = SamplingParams(temperature=0, max_tokens=total, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(f"w1-{i}", p, params))
    started, first = time.perf_counter(), set()
    prefill_steps = 0
    while len(first) < len(prompts):
        first.update(engine.step().request_ids)
        prefill_steps += 1
        if prefill_steps > 10 * len(prompts):
            raise RuntimeError(f"{len(prompts) - len(first)} requests got no token in time")
    _sync()
    prefill_s = time.perf_counter() - started
    for _ in range(args.decode_steps):
        engine.step()
    _sync()
    t0 = time.perf_counter()
    for _ in range(args.timed_steps):
        engine.step()
    _sync()
    wall_ms = (time.perf_counter() - t0) / args.timed_steps * 1e3
    running = engine.scheduler.running
    batch = len(running)
    mean_context = sum(s.num_tokens for s in running) / max(batch, 1)
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        _sync()
        profiled_ms = (time.perf_counter() - t0) / args.steps * 1e3
    kernels = collections.defaultdict(lambda: [0, 0.0])
    sync_us = 0.0
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels[ev.name]
            k[0] += 1
            k[1] += ev.device_time
        elif ev.name in SYNCS:
            sync_us += ev.cpu_time_total
    runner = getattr(engine.executor, "runner", engine.executor)  # TP: rank 0's
    state_bytes = runner.state_bytes_per_slot if runner is not None else 0
    gdn_layers = len(runner.state.layers) if runner is not None and runner.state else 0
    llm.shutdown()
    from atom_kernels import gdn_decode_wide

    launch = {str(k): v for k, v in gdn_decode_wide._launch_shapes.items()}
    return {"w1": w1, "gdn_decode_launch": launch} | summarize(
        kernels, args.steps, wall_ms=wall_ms, profiled_ms=profiled_ms,
        host_ms=profiled_ms - sync_us / 1e3 / args.steps, batch=batch,
        mean_context=mean_context, prefill_s=prefill_s, prefill_steps=prefill_steps,
        state_bytes=state_bytes, gdn_layers=gdn_layers,
    )  # fmt: skip


def summarize(kernels: dict, steps: int, **figures) -> dict:
    """Per-step group and kernel times (us) from the profiler's kernels {name: [count, us]}."""
    groups = collections.defaultdict(lambda: [0.0, 0.0])
    for name, (count, us) in kernels.items():
        g = groups[group_of(name)]
        g[0] += count / steps
        g[1] += us / steps
    kernel_us = sum(us for _, us in groups.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:25]
    out = dict(figures)
    out["kernel_ms"] = kernel_us / 1e3
    out["gpu_idle_share"] = max(0.0, 1 - out["kernel_ms"] / figures["profiled_ms"])
    out["groups"] = {
        name: {"launches": n, "us": us, "share": us / max(kernel_us, 1e-9)}
        for name, (n, us) in sorted(groups.items(), key=lambda kv: -kv[1][1])
    }
    gdn_us = groups["gdn_decode"][1] if "gdn_decode" in groups else 0.0
    if gdn_us and figures["state_bytes"]:
        # Each sequence's conv and recurrent state read and written once a step.
        moved = 2 * figures["state_bytes"] * figures["batch"]
        out["gdn_decode_GBps"] = moved / (gdn_us * 1e-6) / 1e9
    out["top"] = [(n, c / steps, us / steps) for n, (c, us) in top]
    return out


def describe(name: str, r: dict) -> str:
    lines = [
        f"== {name}: batch {r['batch']}, mean context {r['mean_context']:.0f}; decode step "
        f"{r['wall_ms']:.2f} ms wall ({r['profiled_ms']:.2f} profiled), kernels "
        f"{r['kernel_ms']:.2f} ms, GPU idle {r['gpu_idle_share']:.1%}, host "
        f"{r['host_ms']:.2f} ms; prefill phase {r['prefill_s']:.2f} s in {r['prefill_steps']} "
        "steps"
    ]
    if r.get("w1"):
        w1 = r["w1"]
        copy = w1["bound"].get("copy", {})
        lines.append(
            f"   W1 {w1['output_tokens_per_s']:,.0f} tok/s in {w1['seconds']:.2f} s; bound "
            f"{copy.get('bound', float('nan')):,.0f} tok/s (copy), "
            f"{copy.get('atom_share_of_bound', float('nan')):.0%} of it"
        )
    if r.get("gdn_decode_launch"):
        lines.append(f"   GDN decode launch chosen at start-up: {r['gdn_decode_launch']}")
    if "gdn_decode_GBps" in r:
        lines.append(f"   GDN decode moves the state at {r['gdn_decode_GBps']:,.0f} GB/s")
    for g, v in r["groups"].items():
        lines.append(
            f"   {g:22} {v['us'] / 1e3:8.3f} ms {v['share']:6.1%}  {v['launches']:6.1f}/step"
        )
    lines.append("   largest kernels (us a step, launches a step):")
    lines += [f"     {us:9.1f} {n:6.1f}  {k[:100]}" for k, n, us in r["top"]]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--variants", default="split,auto", help="PATH[:STATE_DTYPE],...")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--decode-steps", type=int, default=240)
    parser.add_argument("--timed-steps", type=int, default=20)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--w1",
        action="store_true",
        help="first run W1 itself in each variant's engine (atom bench throughput's run and "
        "bound), so one start-up gives both",
    )
    parser.add_argument("--w1-prompts", type=int, default=256, help="W1's 256 (smaller: tests)")
    parser.add_argument("--w1-output-len", type=int, default=512, help="W1's 512")
    parser.add_argument("--out")
    parser.add_argument("--state-dtype", default="auto", help=argparse.SUPPRESS)
    parser.add_argument("--child", help=argparse.SUPPRESS)  # JSON path: run one variant here
    args = parser.parse_args()
    if args.child:
        result = run_variant(args)
        with open(args.child, "w") as f:
            json.dump(result, f)
        return 0
    results = {}
    for variant in args.variants.split(","):
        path, _, dtype = variant.partition(":")
        child = f"{args.out or 'trace_w1'}.{path}.{dtype or 'auto'}.part.json"
        cmd = [
            sys.executable,
            __file__,
            "--model",
            args.model,
            "--batch",
            str(args.batch),
            "--decode-steps",
            str(args.decode_steps),
            "--timed-steps",
            str(args.timed_steps),
            "--steps",
            str(args.steps),
            "--state-dtype",
            dtype or "auto",
            "--child",
            child,
        ]
        cmd += ["--w1", "--w1-prompts", str(args.w1_prompts), "--w1-output-len",
                str(args.w1_output_len)] if args.w1 else []  # fmt: skip
        env = {**os.environ, "ATOM_GDN_DECODE": path}
        if subprocess.run(cmd, env=env).returncode != 0:
            print(f"variant {variant}: failed", file=sys.stderr)
            continue
        with open(child) as f:
            results[variant] = json.load(f)
        os.remove(child)
        print(describe(variant, results[variant]), flush=True)
    if len(results) > 1:
        names = list(results)
        print("\ngroup ms a step: " + " | ".join(names))
        groups = {g for r in results.values() for g in r["groups"]}
        for g in sorted(groups, key=lambda g: -results[names[0]]["groups"].get(g, {"us": 0})["us"]):
            cells = [f"{results[n]['groups'].get(g, {'us': 0.0})['us'] / 1e3:8.3f}" for n in names]
            print(f"  {g:22} " + " | ".join(cells))
        print("  " + f"{'wall':22} " + " | ".join(f"{results[n]['wall_ms']:8.3f}" for n in names))
        if all(results[n].get("w1") for n in names):
            cells = [f"{results[n]['w1']['output_tokens_per_s']:8.0f}" for n in names]
            print("  " + f"{'W1 tok/s':22} " + " | ".join(cells))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "variants": results}, f, indent=1)
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())

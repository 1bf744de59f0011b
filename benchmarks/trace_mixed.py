"""What a step costs when prefill chunks join decoding sequences (the W5 shape), by kind of step.

python benchmarks/trace_mixed.py --model benchmarks/configs/qwen3.5-4b [--decoding 15] [--out f.json]

Runs the engine (dummy weights): `--decoding` sequences decode while, every few steps, a new
request arrives whose prompt extends a cached one (a follow-up turn: prefix reuse through state
checkpoints on a hybrid model, chunks cut at demand rungs and anchors). Each step's wall time is
recorded with the batch it ran (decode rows, prefill tokens, state copies); steps are grouped by
kind (decode only, mixed) and the slowest mixed steps are traced with torch.profiler (top CPU and
GPU ops). With `--no-prefix-caching` the same arrivals prefill whole.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time

import torch

from atom_runtime import LLM, SamplingParams
from atom_runtime.protocol.engine_core import EngineRequest


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--decoding", type=int, default=15)
    ap.add_argument("--prompt-len", type=int, default=3000)
    ap.add_argument("--new-len", type=int, default=500)
    ap.add_argument("--arrivals", type=int, default=12)
    ap.add_argument("--every", type=int, default=8, help="steps between arrivals")
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    caching = not args.no_prefix_caching
    llm = LLM(args.model, load_format="dummy", max_model_len=16384, enable_prefix_caching=caching)
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    long = SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=130, ignore_eos=True)
    for i in range(args.decoding):
        prompt = [(7919 * i + j) % (vocab - 200) + 100 for j in range(256)]
        engine.add_request(EngineRequest(f"bg{i}", prompt, long))
    bases = [[(104729 * k + 31 * j) % (vocab - 200) + 100 for j in range(args.prompt_len)]
             for k in range(args.arrivals)]  # fmt: skip
    # Each arrival's previous turn: the base prompt plus 128 generated tokens, run once first.
    for k, base in enumerate(bases):
        engine.add_request(EngineRequest(f"prev{k}", base, short))
    finished: dict[str, list[int]] = collections.defaultdict(list)
    while any(not r.startswith("bg") for r in engine.scheduler.requests):
        for out in engine.step():
            finished[out.request_id].extend(out.new_token_ids)
    sync()
    steps = []
    arrivals = 0
    first_token: dict[str, int] = {}
    submitted: dict[str, int] = {}
    batches: list = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        batch = schedule()
        batches.append((len(batch.seqs), batch.total_tokens, batch.state_copy is not None))
        return batch

    engine.scheduler.schedule = recording_schedule
    for n in range(args.arrivals * args.every + 40):
        if n % args.every == 0 and arrivals < args.arrivals:
            k = arrivals
            prompt = bases[k] + finished[f"prev{k}"] + [100 + k] * args.new_len
            rid = f"turn{k}"
            engine.add_request(EngineRequest(rid, prompt, SamplingParams(max_tokens=1)))
            submitted[rid] = n
            arrivals += 1
        batches.clear()
        start = time.perf_counter()
        outs = engine.step()
        wall = time.perf_counter() - start
        rows, tokens, copies = batches[-1] if batches else (0, 0, False)
        steps.append({"step": n, "wall_ms": wall * 1e3, "rows": rows, "tokens": tokens,
                      "copies": copies})  # fmt: skip
        for out in outs:
            if out.request_id.startswith("turn") and out.request_id not in first_token:
                first_token[out.request_id] = n
    engine.scheduler.schedule = schedule
    kinds = collections.defaultdict(list)
    for s in steps:
        kind = "mixed" if s["tokens"] > s["rows"] else "decode"
        kinds[kind + (" + copies" if s["copies"] else "")].append(s["wall_ms"])
    summary = {k: {"steps": len(v), "mean_ms": statistics.fmean(v), "p50_ms": statistics.median(v),
                   "max_ms": max(v)} for k, v in kinds.items()}  # fmt: skip
    ttft_steps = [first_token[r] - submitted[r] for r in first_token]
    print(f"caching={caching}: {json.dumps(summary)}")
    print(f"TTFT in steps: {ttft_steps}")
    ck = engine.checkpoints
    if ck is not None:
        print("checkpoint counters:", ck.counters)
    # Profile a few more arrivals (mixed steps) to see where their time goes.
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    base = bases[0] + finished["prev0"] + [150] * args.new_len
    with torch.profiler.profile(activities=acts) as prof:
        for k in range(3):
            prompt = base + [160 + k] * args.new_len
            engine.add_request(EngineRequest(f"prof{k}", prompt, SamplingParams(max_tokens=1)))
            for _ in range(6):
                engine.step()
        sync()
    table = prof.key_averages().table(
        sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70
    )
    print(table)
    gpu = prof.key_averages().table(
        sort_by="self_device_time_total", row_limit=15, max_name_column_width=70
    )
    print(gpu)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summary": summary, "ttft_steps": ttft_steps, "steps": steps,
                       "profile_cpu": table, "profile_gpu": gpu}, f, indent=2)  # fmt: skip


if __name__ == "__main__":
    main()

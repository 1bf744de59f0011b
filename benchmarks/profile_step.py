"""Where one engine step's time goes: cProfile over steady-state decode steps.

python benchmarks/profile_step.py --model benchmarks/configs/qwen3-0.6b --batch 256
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from atom_runtime import LLM, SamplingParams
from atom_runtime.protocol.engine_core import EngineRequest


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    llm = LLM(args.model, load_format="dummy")
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=args.steps + 20, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(EngineRequest(f"p{i}", [100 + i] * args.prompt_len, params))
    for _ in range(10):  # prefill and warm up
        engine.step()
    import torch

    torch.cuda.synchronize()
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    for _ in range(args.steps):
        engine.step()
    prof.disable()
    elapsed = time.perf_counter() - start
    print(f"batch {args.batch}: {elapsed / args.steps * 1000:.3f} ms/step")
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()

"""Same tokens with async scheduling on and off on a W1-shaped workload (GPU check).

python benchmarks/debug_async.py --model benchmarks/configs/qwen3-0.6b [--eager]
"""

from __future__ import annotations

import argparse
import random

from atom_runtime import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--mode", choices=["on", "off"], required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rng = random.Random(0)
    prompts = [
        [rng.randrange(100, 150000) for _ in range(rng.randint(100, 1024))]
        for _ in range(args.num_prompts)
    ]
    llm = LLM(
        args.model,
        load_format="dummy",
        enforce_eager=args.eager,
        async_scheduling=args.mode == "on",
        max_num_batched_tokens=4096,
    )
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    with open(args.out, "w") as f:
        for o in outs:
            f.write(" ".join(map(str, o.outputs[0].token_ids)) + "\n")


if __name__ == "__main__":
    main()

"""What a 16-bit recurrent state (`--mamba-ssm-cache-dtype`) costs in accuracy, on the tiny random
hybrids of tests/model_factory.py (Qwen3.5, Qwen3.5-MoE, Qwen3-Next), on CPU.

    python benchmarks/state_dtype_accuracy.py --tokens 300 --out state_dtype_accuracy.json

Teacher-forced: one sequence of random token ids is fed to the engine one token a step (a step
budget of one token, so every position runs the decode path and stores the state in its dtype
between tokens, as decoding does), and the engine's log-probabilities at every position
(`prompt_logprobs`: the 20 most likely next tokens and the one that follows) are compared with
transformers' fp32 forward over the whole sequence and with the engine's own fp32-state run:

- agreement: the share of positions whose most likely next token is the reference's;
- log-prob error: |engine - reference| over those tokens at every position, max and mean (the
  log-softmax, so a shift shared by every logit does not count).

The model runs in fp32 (`--model-dtype`), so the only difference between the engine's runs is
the state's dtype; `--model-dtype bfloat16` shows it beside a bf16 model's own rounding.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
TOP = 20  # log-probs compared per position: the engine's top 20 and the realized token


def engine_logprobs(folder: Path, ids: list[int], ssm_dtype: str, model_dtype: str) -> list:
    """The engine's log-probs at positions 1.. of `ids`, teacher-forced one token a step:
    per position {token id: log-prob} (the top TOP and the realized token)."""
    from atom_runtime import LLM, SamplingParams

    llm = LLM(
        str(folder),
        dtype=model_dtype,
        max_num_batched_tokens=1,
        num_gpu_blocks_override=len(ids) // 16 + 4,
        max_num_seqs=1,
        enable_prefix_caching=False,
        mamba_ssm_cache_dtype=ssm_dtype,
    )
    try:
        params = SamplingParams(max_tokens=1, prompt_logprobs=TOP, temperature=0)
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    finally:
        llm.shutdown()
    return out.prompt_logprobs[1:]


def compare(got: list, want) -> dict:
    """Agreement of the most likely next token and the log-prob error over the tokens `got`
    holds, position by position; `want` is another engine run (a list) or the reference's
    log-softmax rows."""
    agree, errors = 0, []
    for i, row in enumerate(got):
        if isinstance(want, list):
            ref = want[i]
            shared = [t for t in row if t in ref]
            ref_top = max(ref, key=ref.get)
            errors += [abs(row[t] - ref[t]) for t in shared]
        else:
            ref_row = want[i]
            ref_top = int(ref_row.argmax())
            errors += [abs(row[t] - float(ref_row[t])) for t in row]
        agree += max(row, key=row.get) == ref_top
    return {
        "agreement": agree / len(got),
        "logprob_err_max": max(errors),
        "logprob_err_mean": math.fsum(errors) / len(errors),
    }


def measure(folder: Path, tokens: int, seed: int, model_dtype: str, vocab: int) -> dict:
    """One model: the engine with each recurrent state dtype against transformers' fp32 and
    against the engine's fp32-state run."""
    from tests.hf_reference import hf_logprobs, random_prompts
    from tests.model_factory import hybrid_references_on_torch

    ids = random_prompts(seed, [tokens], vocab)[0]
    hybrid_references_on_torch()  # transformers' pure-torch Gated DeltaNet, fp32
    reference = hf_logprobs(folder, [ids])[0][:-1]  # what follows positions 0 .. len - 2
    runs = {d: engine_logprobs(folder, ids, d, model_dtype) for d in ("float32", "bfloat16",
                                                                       "float16")}  # fmt: skip
    result = {}
    for d, got in runs.items():
        result[d] = {"vs_transformers_fp32": compare(got, reference)}
        if d != "float32":
            result[d]["vs_engine_fp32_state"] = compare(got, runs["float32"])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--out", help="write the figures to this JSON file")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))  # tests.model_factory builds the tiny models
    from tests.model_factory import VOCAB, make_tiny_model

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.kinds.split(","):
            folder = make_tiny_model(Path(tmp) / kind, kind)
            results[kind] = measure(folder, args.tokens, args.seed, args.model_dtype, VOCAB)
            for d, r in results[kind].items():
                for against, c in r.items():
                    print(
                        f"{kind:12} state {d:8} {against:22} agreement {c['agreement']:.3f}  "
                        f"log-prob error max {c['logprob_err_max']:.2e} "
                        f"mean {c['logprob_err_mean']:.2e}",
                        flush=True,
                    )
    if args.out:
        meta = {"tokens": args.tokens, "seed": args.seed, "model_dtype": args.model_dtype}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

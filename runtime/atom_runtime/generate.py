"""`atom generate`: generate text offline for one or more prompts."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from atom_runtime.config import EngineConfig
from atom_runtime.engine_args import add_engine_arguments
from atom_runtime.models.preflight import preflight
from atom_runtime.system.process import LOG_FORMAT, LOG_LEVELS, log_level


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prompt", action="append", required=True, help="a prompt (repeat for several)"
    )
    parser.add_argument("--chat", action="store_true", help="apply the model's chat template")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    parser.add_argument("--top-k", type=int, default=0, help="0: no top-k cut")
    parser.add_argument("--ignore-eos", action="store_true", help="generate past end-of-text")
    parser.add_argument(
        "--log-level",
        type=log_level,
        default="info",
        choices=LOG_LEVELS,
        help="log level on stderr, any case; debug also shows tracebacks of start-up errors",
    )
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    try:
        preflight(EngineConfig.from_args(args))  # before torch is even imported
    except (ValueError, FileNotFoundError) as e:
        if args.log_level == "debug":
            raise
        print(f"atom generate: error: {e}", file=sys.stderr)
        return 2
    from atom_runtime.llm import LLM
    from atom_runtime.sampling_params import SamplingParams

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            ignore_eos=args.ignore_eos,
            seed=args.seed,
        )
        config = EngineConfig.from_args(args)
        kwargs = {k: v for k, v in vars(config).items() if k != "model"}
        llm = LLM(config.model, **kwargs)
    except (ValueError, FileNotFoundError) as e:
        if args.log_level == "debug":
            raise
        print(f"atom generate: error: {e}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
    else:
        outs = llm.generate(args.prompt, params)
    elapsed = time.perf_counter() - start
    tokens = 0
    for prompt, out in zip(args.prompt, outs, strict=True):
        text = out.outputs[0].text
        tokens += len(out.outputs[0].token_ids)
        print(f"{prompt}{text}" if not args.chat else text)
    print(f"[{tokens} tokens in {elapsed:.2f}s, {tokens / elapsed:.1f} tok/s]", file=sys.stderr)
    llm.shutdown()
    return 0

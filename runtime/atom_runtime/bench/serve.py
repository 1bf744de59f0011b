"""`atom bench serve`: the online-serving benchmark (W4), shaped like `vllm bench serve`.

It drives any OpenAI-compatible endpoint (ours or another server) with streaming requests, at a
fixed request rate (Poisson arrivals, or gamma-distributed gaps with `--burstiness`) and/or under
a cap on requests in flight (`--max-concurrency`), and reports what vLLM reports, under vLLM's
flag names and result keys, so users' scripts and plots carry over:

    atom bench serve --base-url http://127.0.0.1:8000 --dataset-name sharegpt \
        --num-prompts 200 --request-rate 8 --save-result

Definitions (as vLLM's): TTFT is from sending the request to the first streamed chunk that
carries a choice; ITL is the gap between consecutive such chunks (one entry per chunk, not per
token); TPOT is (latency - TTFT) / (output tokens - 1), so it excludes the first token; E2EL is
the client-side latency of the whole request. Output token counts are the server's
`usage.completion_tokens` (streamed with `stream_options.include_usage`).

The `random` and `sharegpt` datasets send token-id prompts to `/v1/completions` (exact lengths,
no tokenizer round trip); `openai-chat` needs text and so a tokenizer (`--tokenizer`).

The modules: bench_serve_datasets (the prompts), bench_serve_client (requests and arrivals),
bench_serve_metrics (the result dict and report); this one holds the flags, the run and the file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from datetime import datetime

from atom_runtime.bench.serve_client import (
    _probe,
    arrival_offsets,
    benchmark,
    count_missing_usage,
)
from atom_runtime.bench.serve_datasets import BenchError, get_samples, load_token_source
from atom_runtime.bench.serve_metrics import (
    PERCENTILE_METRICS,
    calculate_metrics,
    format_report,
    parse_goodput,
)
from atom_runtime.system.flag_table import add_number_flags

# Per-request lists dropped from the saved file unless --save-detailed (as vLLM does).
DETAILED_FIELDS = ("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors")


# -- arguments ---------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    """vLLM's `bench serve` flags: the endpoint, the dataset, the traffic, the results."""
    for add in (_add_endpoint_arguments, _add_dataset_arguments, _add_traffic_arguments,
                _add_result_arguments):  # fmt: skip
        add(p)


def _add_endpoint_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--backend",
        choices=["openai", "openai-chat"],
        default="openai",
        help="openai: /v1/completions; openai-chat: /v1/chat/completions",
    )
    p.add_argument("--base-url", default=None, help="server URL, instead of --host/--port")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--endpoint",
        default=None,
        help="API path (default /v1/completions, or /v1/chat/completions for openai-chat)",
    )
    p.add_argument(
        "--model", default=None, help="model name to send (default: the server's first model)"
    )
    p.add_argument(
        "--served-model-name", default=None, help="name sent in requests, if not --model"
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer folder or repo id (default: --model); needed for text prompts",
    )
    p.add_argument(
        "--ready-check-timeout-sec",
        type=int,
        default=600,
        help="seconds to wait for the server to accept connections (it says so every 15 s), "
        "then give up",
    )
    p.add_argument("--request-timeout", type=float, default=6 * 3600, help="seconds per request")


def _add_dataset_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset-name", choices=["random", "sharegpt", "custom"], default="random")
    p.add_argument(
        "--dataset-path",
        default=None,
        help="sharegpt: a ShareGPT JSON file (default: the synthetic mix); custom: a JSONL file",
    )
    add_number_flags(p, num_prompts=1000, random_input_len=1024, random_output_len=128)
    p.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [len*(1-r), len*(1+r)], 0 <= r < 1",
    )
    p.add_argument("--random-prefix-len", type=int, default=0, help="shared random prefix tokens")
    p.add_argument("--sharegpt-output-len", type=int, default=None)
    p.add_argument("--custom-output-len", type=int, default=256)
    p.add_argument(
        "--custom-skip-chat-template",
        action="store_true",
        help="send custom prompts as they are instead of through the chat template",
    )


def _add_traffic_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second (inf: all at once)",
    )
    p.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of arrival gaps: 1 Poisson, <1 burstier, >1 more uniform",
    )
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--temperature", type=float, default=None, help="sent when given")


def _add_result_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--label", default=None, help="prefix of the result file (default: backend)")
    p.add_argument(
        "--percentile-metrics",
        default="ttft,tpot,itl",
        help=f"comma-separated, from {','.join(PERCENTILE_METRICS)}",
    )
    p.add_argument(
        "--metric-percentiles", default="90,99", help="comma-separated percentiles, e.g. 50,90,99"
    )
    p.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="KEY:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:2000",
    )
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--save-detailed", action="store_true", help="keep per-request lists too")
    p.add_argument("--result-dir", default=None)
    p.add_argument("--result-filename", default=None)
    p.add_argument("--metadata", nargs="*", default=None, metavar="KEY=VALUE")
    p.add_argument("--disable-tqdm", action="store_true")


def _parse_list(text: str, flag: str, allowed: tuple[str, ...] | None = None) -> list:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if allowed is not None:
        bad = [t for t in items if t not in allowed]
        if bad:
            raise BenchError(f"{flag}: unknown {bad}; choose from {', '.join(allowed)}")
        return items
    try:
        values = [float(t) for t in items]
    except ValueError as e:
        raise BenchError(f"{flag}: expected numbers, got {text!r}") from e
    if any(not 0 < v <= 100 for v in values):
        raise BenchError(f"{flag}: percentiles must be in (0, 100]")
    return values


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except BenchError as e:
        print(f"atom bench serve: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # e.g. --result-dir not writable
        print(f"atom bench serve: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("atom bench serve: interrupted", file=sys.stderr)
        return 130


def _run(args: argparse.Namespace) -> int:
    metrics = _parse_list(args.percentile_metrics, "--percentile-metrics", PERCENTILE_METRICS)
    pcts = _parse_list(args.metric_percentiles, "--metric-percentiles")
    goodput = parse_goodput(args.goodput)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise BenchError(f"--max-concurrency: must be >= 1, got {args.max_concurrency}")
    arrival_offsets(1, args.request_rate, args.burstiness, args.seed)  # validates both
    # Reach the server first: without --model, its first model names the model and, by
    # default, the tokenizer (as vLLM does).
    server_model = asyncio.run(_probe(args))
    args.model_id = args.model or server_model
    src = load_token_source(args.tokenizer or args.model_id)
    samples = get_samples(args, src)
    run_out = asyncio.run(benchmark(args, samples))
    outputs, duration = run_out["outputs"], run_out["duration"]
    count_missing_usage(outputs, src)
    result = calculate_metrics(outputs, duration, pcts, metrics, goodput)
    failed = [o.error for o in outputs if not o.success]
    if failed:
        print(f"{len(failed)} request(s) failed; the first ones:")
        for err in failed[:10]:
            print(f"  {err}")
    if not result["completed"]:
        print("warning: every request failed; check the benchmark's arguments", file=sys.stderr)
    print(format_report(result, args, metrics, pcts))
    if args.save_result or args.result_filename:
        path = save_result(args, result, len(samples))
        print(f"result saved to {path}")
    return 0


def save_result(args: argparse.Namespace, result: dict, num_prompts: int) -> str:
    now = datetime.now().strftime("%Y%m%d-%H%M%S")
    model_id = args.model_id or "model"
    doc: dict = {
        "date": now,
        "endpoint_type": args.backend,
        "backend": args.backend,
        "label": args.label,
        "model_id": model_id,
        "tokenizer_id": args.tokenizer or args.model_id,
        "num_prompts": num_prompts,
        "request_rate": args.request_rate if not math.isinf(args.request_rate) else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
    }
    for kv in args.metadata or []:
        key, sep, value = kv.partition("=")
        if not sep:
            raise BenchError(f"--metadata {kv!r}: expected KEY=VALUE")
        doc[key] = value
    doc.update(result)
    if not args.save_detailed:
        for key in DETAILED_FIELDS:
            doc.pop(key, None)
    conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
    name = args.result_filename or (
        f"{args.label or args.backend}-{args.request_rate}qps{conc}-"
        f"{model_id.rstrip('/').split('/')[-1]}-{now}.json"
    )
    if args.result_dir:
        os.makedirs(args.result_dir, exist_ok=True)
        name = os.path.join(args.result_dir, name)
    with open(name, "w") as f:
        json.dump(doc, f, indent=2)
    return name

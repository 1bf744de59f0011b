"""`atom bench serve`'s metrics: vLLM's result dict (TTFT, TPOT, ITL, E2EL, goodput, peaks)
from the requests' outputs, and the printed report."""

from __future__ import annotations

import argparse
import math

import numpy as np

from atom_runtime.bench.serve_client import RequestOutput
from atom_runtime.bench.serve_datasets import BenchError

GOODPUT_METRICS = ("ttft", "tpot", "e2el")
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")


# -- metrics -----------------------------------------------------------------------------------


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    slos: dict[str, float] = {}
    for pair in pairs or []:
        name, sep, value = pair.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = None
        if not sep or ms is None:
            raise BenchError(f"--goodput {pair!r}: expected KEY:MILLISECONDS, e.g. ttft:500")
        if name not in GOODPUT_METRICS:
            raise BenchError(f"--goodput {pair!r}: KEY must be one of {', '.join(GOODPUT_METRICS)}")
        if ms < 0:
            raise BenchError(f"--goodput {pair!r}: the SLO must be >= 0 ms")
        slos[name] = ms
    return slos


def _percentile_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def calculate_metrics(
    outputs: list[RequestOutput],
    duration: float,
    percentiles: list[float],
    metrics: list[str],
    goodput: dict[str, float],
) -> dict:
    """vLLM's result keys, computed vLLM's way (numpy percentiles, times in ms)."""
    ok = [o for o in outputs if o.success]
    ttfts = [o.ttft for o in ok]
    e2els = [o.latency for o in ok]
    itls = [gap for o in ok for gap in o.itl]
    tpots = [(o.latency - o.ttft) / (o.output_tokens - 1) for o in ok if o.output_tokens > 1]
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(o.output_tokens for o in ok)
    good = 0
    if goodput:
        for o in ok:
            tpot = (o.latency - o.ttft) / (o.output_tokens - 1) if o.output_tokens > 1 else 0.0
            values = {"ttft": o.ttft, "tpot": tpot, "e2el": o.latency}
            if all(values[k] * 1000 <= slo for k, slo in goodput.items()):
                good += 1
    # Peak concurrency: a sweep over [start, end) intervals, ends before starts at a tie.
    events = sorted([(o.start_time, 1) for o in ok] + [(o.start_time + o.latency, -1) for o in ok])
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    # Peak output tokens in any one-second bucket, placing a request's tokens at its chunks.
    max_tok_s = 0.0
    if ok:
        t0 = min(o.start_time for o in ok)
        buckets: dict[int, int] = {}
        for o in ok:
            t = o.start_time + o.ttft
            stamps = [t]
            for gap in o.itl:
                t += gap
                stamps.append(t)
            for s in stamps:
                buckets[int(s - t0)] = buckets.get(int(s - t0), 0) + 1
        max_tok_s = float(max(buckets.values()))
    result: dict = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "request_goodput": good / duration if goodput else None,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "max_output_tokens_per_s": max_tok_s,
        "max_concurrent_requests": peak,
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": [o.output_tokens if o.success else 0 for o in outputs],
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "latencies": [o.latency for o in outputs],
        "start_times": [o.start_time for o in outputs],
        "queue_times": [o.client_queue_time for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
    }
    series = {"ttft": ttfts, "tpot": tpots, "itl": itls, "e2el": e2els}
    for name in metrics:
        values = series[name] or [0.0]
        result[f"mean_{name}_ms"] = float(np.mean(values)) * 1000
        result[f"median_{name}_ms"] = float(np.median(values)) * 1000
        result[f"std_{name}_ms"] = float(np.std(values)) * 1000
        for p in percentiles:
            result[f"p{_percentile_word(p)}_{name}_ms"] = float(np.percentile(values, p)) * 1000
    return result


_HEADERS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


def format_report(result: dict, args: argparse.Namespace, metrics: list[str], pcts: list[float]):
    rows = ["{:=^50}".format(" Serving Benchmark Result ")]

    def row(label: str, value, fmt: str = "{:<10}") -> None:
        rows.append(f"{label:<40} " + fmt.format(value))

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    if args.max_concurrency is not None:
        row("Maximum request concurrency:", args.max_concurrency)
    if not math.isinf(args.request_rate):
        row("Request rate configured (RPS):", args.request_rate, "{:<10.2f}")
    row("Benchmark duration (s):", result["duration"], "{:<10.2f}")
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"], "{:<10.2f}")
    if result["request_goodput"] is not None:
        row("Request goodput (req/s):", result["request_goodput"], "{:<10.2f}")
    row("Output token throughput (tok/s):", result["output_throughput"], "{:<10.2f}")
    row("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"], "{:<10.2f}")
    row("Peak concurrent requests:", result["max_concurrent_requests"], "{:<10.2f}")
    row("Total token throughput (tok/s):", result["total_token_throughput"], "{:<10.2f}")
    for name in metrics:
        short, header = _HEADERS[name]
        rows.append(f"{header:-^50}")
        row(f"Mean {short} (ms):", result[f"mean_{name}_ms"], "{:<10.2f}")
        row(f"Median {short} (ms):", result[f"median_{name}_ms"], "{:<10.2f}")
        for p in pcts:
            w = _percentile_word(p)
            row(f"P{w} {short} (ms):", result[f"p{w}_{name}_ms"], "{:<10.2f}")
    rows.append("=" * 50)
    return "\n".join(rows)

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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np

# The W4 ShareGPT-shaped synthetic mix: log-normal prompt and reply lengths (medians and spreads
# chosen to match the filtered ShareGPT_V3 set vLLM benchmarks with: prompts 4..1024 tokens, prompt
# plus reply at most 2048), drawn from --seed. A stand-in for the file, not a copy of it.
SHAREGPT_PROMPT_MEDIAN, SHAREGPT_PROMPT_SIGMA = 110.0, 1.1
SHAREGPT_OUTPUT_MEDIAN, SHAREGPT_OUTPUT_SIGMA = 150.0, 1.0
SHAREGPT_MAX_PROMPT, SHAREGPT_MAX_TOTAL, SHAREGPT_MIN_LEN = 1024, 2048, 4
# Random-token prompts avoid the lowest ids, where tokenizers keep their special tokens (W1).
RANDOM_TOKEN_LOW = 100
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
# Per-request lists dropped from the saved file unless --save-detailed (as vLLM does).
DETAILED_FIELDS = ("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors")


class BenchError(RuntimeError):
    """A problem with the benchmark's arguments or the endpoint: printed as one line, no trace."""


# -- arguments ---------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
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
    p.add_argument("--label", default=None, help="prefix of the result file (default: backend)")
    p.add_argument("--dataset-name", choices=["random", "sharegpt", "custom"], default="random")
    p.add_argument(
        "--dataset-path",
        default=None,
        help="sharegpt: a ShareGPT JSON file (default: the synthetic mix); custom: a JSONL file",
    )
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
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
    p.add_argument(
        "--ready-check-timeout-sec",
        type=int,
        default=600,
        help="how long the first test request retries while the endpoint refuses connections",
    )
    p.add_argument("--request-timeout", type=float, default=6 * 3600, help="seconds per request")


# -- datasets ----------------------------------------------------------------------------------


@dataclass
class SampleRequest:
    prompt: str | list[int]
    prompt_len: int
    expected_output_len: int


@dataclass
class TokenSource:
    """What the client knows of the model's vocabulary: a tokenizer, or only its size."""

    tokenizer: object | None  # atom_runtime.tokenizer.Tokenizer
    vocab_size: int | None
    name: str | None


def load_token_source(name: str | None) -> TokenSource:
    """A tokenizer from a local folder/file or hub repo id; failing that, the vocabulary size
    from a config.json (dummy-weight configs ship no tokenizer); failing that, nothing."""
    if not name:
        return TokenSource(None, None, None)
    from atom_runtime.models.loader import resolve_model_path
    from atom_runtime.tokenizer import Tokenizer

    try:
        path = resolve_model_path(name)
    except FileNotFoundError:
        return TokenSource(None, None, name)
    try:
        tok = Tokenizer.from_path(path)
        return TokenSource(tok, tok.vocab_size, name)
    except (FileNotFoundError, ValueError):
        pass
    cfg = (path if path.is_dir() else path.parent) / "config.json"
    if cfg.is_file():
        vocab = json.loads(cfg.read_text()).get("vocab_size")
        if isinstance(vocab, int):
            return TokenSource(None, vocab, name)
    return TokenSource(None, None, name)


def _random_ids(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    high = min(vocab, 150000)
    low = RANDOM_TOKEN_LOW if high > RANDOM_TOKEN_LOW + 1 else 0
    return rng.integers(low, high, size=n).tolist()


def _need_vocab(src: TokenSource, dataset: str) -> int:
    if src.vocab_size is None:
        raise BenchError(
            f"--dataset-name {dataset}: random token prompts need the model's vocabulary; "
            f"could not load a tokenizer or config.json from {src.name!r} "
            "(pass --tokenizer PATH, a model folder)"
        )
    return src.vocab_size


def sample_random(
    src: TokenSource,
    num: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    prefix_len: int,
    seed: int,
) -> list[SampleRequest]:
    """vLLM's `random` dataset: lengths uniform in [floor(len*(1-r)), ceil(len*(1+r))]."""
    if not 0.0 <= range_ratio < 1.0:
        raise BenchError(f"--random-range-ratio: must be in [0, 1), got {range_ratio}")
    if input_len < 1 or output_len < 1:
        raise BenchError("--random-input-len and --random-output-len: must be >= 1")
    vocab = _need_vocab(src, "random")
    rng = np.random.default_rng(seed)
    in_lo, in_hi = (
        math.floor(input_len * (1 - range_ratio)),
        math.ceil(input_len * (1 + range_ratio)),
    )
    out_lo = math.floor(output_len * (1 - range_ratio))
    out_hi = math.ceil(output_len * (1 + range_ratio))
    in_lens = rng.integers(max(in_lo, 1), in_hi + 1, size=num)
    out_lens = rng.integers(max(out_lo, 1), out_hi + 1, size=num)
    prefix = _random_ids(rng, prefix_len, vocab)
    return [
        SampleRequest(prefix + _random_ids(rng, int(n), vocab), prefix_len + int(n), int(o))
        for n, o in zip(in_lens, out_lens, strict=True)
    ]


def sample_sharegpt_synthetic(
    src: TokenSource, num: int, output_len: int | None, seed: int
) -> list[SampleRequest]:
    """The ShareGPT-shaped synthetic mix: log-normal lengths, filtered as vLLM filters ShareGPT."""
    vocab = _need_vocab(src, "sharegpt")
    rng = np.random.default_rng(seed)
    out: list[SampleRequest] = []
    while len(out) < num:
        p = int(rng.lognormal(math.log(SHAREGPT_PROMPT_MEDIAN), SHAREGPT_PROMPT_SIGMA))
        o = int(rng.lognormal(math.log(SHAREGPT_OUTPUT_MEDIAN), SHAREGPT_OUTPUT_SIGMA))
        if output_len is not None:
            o = output_len
        if p < SHAREGPT_MIN_LEN or o < SHAREGPT_MIN_LEN:
            continue
        if p > SHAREGPT_MAX_PROMPT or p + o > SHAREGPT_MAX_TOTAL:
            continue
        out.append(SampleRequest(_random_ids(rng, p, vocab), p, o))
    return out


def sample_sharegpt_file(
    src: TokenSource, path: str, num: int, output_len: int | None, seed: int
) -> list[SampleRequest]:
    """Real ShareGPT conversations: the first human turn is the prompt, the reply sets the
    output length; filtered like vLLM (lengths >= 4, prompt <= 1024, total <= 2048)."""
    if src.tokenizer is None:
        raise BenchError("--dataset-path with sharegpt: counting prompt tokens needs --tokenizer")
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise BenchError(f"--dataset-path {path}: cannot read ShareGPT JSON: {e}") from e
    convs = [
        d["conversations"]
        for d in data
        if isinstance(d, dict) and len(d.get("conversations") or []) >= 2
    ]
    np.random.default_rng(seed).shuffle(convs)
    out: list[SampleRequest] = []
    for conv in convs:
        if len(out) == num:
            break
        prompt, reply = conv[0].get("value", ""), conv[1].get("value", "")
        p = len(src.tokenizer.encode(prompt))
        o = output_len if output_len is not None else len(src.tokenizer.encode(reply))
        if p < SHAREGPT_MIN_LEN or o < SHAREGPT_MIN_LEN:
            continue
        if p > SHAREGPT_MAX_PROMPT or p + o > SHAREGPT_MAX_TOTAL:
            continue
        out.append(SampleRequest(prompt, p, o))
    if len(out) < num:
        raise BenchError(f"--dataset-path {path}: only {len(out)} usable conversations, need {num}")
    return out


def sample_custom(
    src: TokenSource, path: str | None, num: int, output_len: int, skip_template: bool, chat: bool
) -> list[SampleRequest]:
    """A JSONL file, one {"prompt": "..."} per line (vLLM's `custom` dataset); a line may also
    give its own "output_tokens". Completions prompts go through the chat template unless
    --custom-skip-chat-template (as vLLM does); chat requests carry the text as the user turn."""
    if not path:
        raise BenchError("--dataset-name custom: needs --dataset-path FILE.jsonl")
    rows = []
    try:
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    rows.append((n, json.loads(line)))
    except OSError as e:
        raise BenchError(f"--dataset-path {path}: {e}") from e
    except ValueError as e:
        raise BenchError(f"--dataset-path {path}: line {n} is not JSON: {e}") from e
    out = []
    tok = src.tokenizer
    for n, row in rows[:num]:
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise BenchError(f'--dataset-path {path}: line {n} needs a string "prompt"')
        prompt = row["prompt"]
        if not chat and not skip_template and tok is not None and tok.chat_template:
            prompt = tok.apply_chat_template([{"role": "user", "content": prompt}])
        plen = len(tok.encode(prompt)) if tok is not None else 0
        out.append(SampleRequest(prompt, plen, int(row.get("output_tokens", output_len))))
    if len(out) < num:
        raise BenchError(f"--dataset-path {path}: {len(out)} prompts, --num-prompts is {num}")
    return out


def get_samples(args: argparse.Namespace, src: TokenSource) -> list[SampleRequest]:
    if args.num_prompts < 1:
        raise BenchError(f"--num-prompts: must be >= 1, got {args.num_prompts}")
    if args.dataset_name == "random":
        samples = sample_random(
            src,
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.random_prefix_len,
            args.seed,
        )
    elif args.dataset_name == "sharegpt":
        if args.dataset_path:
            samples = sample_sharegpt_file(
                src, args.dataset_path, args.num_prompts, args.sharegpt_output_len, args.seed
            )
        else:
            samples = sample_sharegpt_synthetic(
                src, args.num_prompts, args.sharegpt_output_len, args.seed
            )
    else:
        samples = sample_custom(
            src,
            args.dataset_path,
            args.num_prompts,
            args.custom_output_len,
            args.custom_skip_chat_template,
            args.backend == "openai-chat",
        )
    if args.backend == "openai-chat":
        for s in samples:
            if not isinstance(s.prompt, str):
                if src.tokenizer is None:
                    raise BenchError(
                        "--backend openai-chat: chat messages are text; token prompts of the "
                        f"{args.dataset_name} dataset need --tokenizer to decode them"
                    )
                s.prompt = src.tokenizer.decode(s.prompt)
    return samples


# -- one request -------------------------------------------------------------------------------


@dataclass
class RequestOutput:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    generated_text: str = ""
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    client_queue_time: float = 0.0
    error: str = ""


def build_payload(
    backend: str, model: str, sample: SampleRequest, ignore_eos: bool, temperature: float | None
) -> dict:
    body: dict = {
        "model": model,
        "max_tokens": sample.expected_output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if backend == "openai-chat":
        body["messages"] = [{"role": "user", "content": sample.prompt}]
        body["max_completion_tokens"] = body.pop("max_tokens")
    else:
        body["prompt"] = sample.prompt
    if ignore_eos:
        body["ignore_eos"] = True
    if temperature is not None:
        body["temperature"] = temperature
    return body


async def send_request(client, url: str, body: dict, sample: SampleRequest) -> RequestOutput:
    """One streaming request; never raises: a failure is recorded in the output."""
    import msgspec

    out = RequestOutput(prompt_len=sample.prompt_len)
    chat = "messages" in body
    out.start_time = start = time.perf_counter()
    last = start
    texts: list[str] = []
    got_first = False
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")[:500]
                out.error = f"HTTP {resp.status_code}: {detail}"
                return out
            buf = b""
            async for piece in resp.aiter_bytes():
                # SSE allows CRLF line ends (sse-starlette sends them): fold them to LF.
                buf = (buf + piece).replace(b"\r\n", b"\n")
                while True:
                    cut = buf.find(b"\n\n")
                    if cut < 0:
                        break
                    event, buf = buf[:cut], buf[cut + 2 :]
                    for line in event.split(b"\n"):
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            continue
                        msg = msgspec.json.decode(data)
                        if msg.get("error"):
                            out.error = f"stream error: {msg['error']}"
                            return out
                        now = time.perf_counter()
                        if choices := msg.get("choices"):
                            c = choices[0]
                            text = (c.get("delta") or {}).get("content") if chat else c.get("text")
                            if not got_first:
                                got_first = True
                                out.ttft = now - start
                            else:
                                out.itl.append(now - last)
                            last = now
                            texts.append(text or "")
                        # Usage rides its own final chunk, or (continuous usage) every chunk.
                        if usage := msg.get("usage"):
                            out.output_tokens = usage.get("completion_tokens") or 0
                            if usage.get("prompt_tokens"):
                                out.prompt_len = usage["prompt_tokens"]
        out.latency = last - start
        out.generated_text = "".join(texts)
        if not got_first:
            out.error = "the stream carried no choice"
        else:
            # A server that ignores stream_options sends no usage: output_tokens stays 0 and
            # count_missing_usage() counts the text's tokens afterwards, as vLLM does.
            out.success = True
    except Exception as e:  # any transport or protocol failure counts against this request only
        out.error = f"{type(e).__name__}: {e}"
    return out


def count_missing_usage(outputs: list[RequestOutput], src: TokenSource) -> int:
    """Output tokens for successful requests whose server reported no usage: the generated
    text's tokens with the tokenizer, else one per streamed chunk. Returns how many."""
    missing = [o for o in outputs if o.success and not o.output_tokens]
    for o in missing:
        if src.tokenizer is not None:
            o.output_tokens = len(src.tokenizer.encode(o.generated_text, add_special_tokens=False))
        else:
            o.output_tokens = len(o.itl) + 1
    if missing:
        how = "tokenizing their text" if src.tokenizer is not None else "one per streamed chunk"
        print(f"{len(missing)} response(s) carried no usage; output tokens counted by {how}")
    return len(missing)


# -- arrivals ----------------------------------------------------------------------------------


def arrival_offsets(n: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: gamma-distributed gaps of mean
    1/rate (shape = burstiness; 1 is a Poisson process), rescaled so the last arrival lands at
    n/rate exactly (as vLLM does, so throughput is stable across seeds)."""
    if request_rate <= 0:
        raise BenchError(f"--request-rate: must be > 0, got {request_rate}")
    if burstiness <= 0:
        raise BenchError(f"--burstiness: must be > 0, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * n
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / request_rate)
    else:
        rng = np.random.default_rng(seed)
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    offsets = np.cumsum(gaps)
    if offsets[-1] > 0:
        offsets *= (n / request_rate) / offsets[-1]
    return offsets.tolist()


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


# -- the run -----------------------------------------------------------------------------------


def _base_url(args: argparse.Namespace) -> str:
    return (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")


def _endpoint(args: argparse.Namespace) -> str:
    if args.endpoint:
        return args.endpoint
    return "/v1/chat/completions" if args.backend == "openai-chat" else "/v1/completions"


async def _ready_check(client, base: str, args: argparse.Namespace) -> str | None:
    """Wait (up to --ready-check-timeout-sec) for the endpoint to accept connections, asking
    GET /v1/models; returns the server's first model name when --model is not given."""
    import httpx

    deadline = time.monotonic() + max(args.ready_check_timeout_sec, 0)
    while True:
        try:
            resp = await client.get(f"{base}/v1/models")
            break
        except httpx.TransportError as e:
            if time.monotonic() >= deadline:
                raise BenchError(
                    f"cannot reach {base}: {type(e).__name__}: {e} (is the server running? "
                    "set --base-url or --host/--port)"
                ) from e
            await asyncio.sleep(1.0)
    if args.model:
        return None
    try:
        data = resp.json().get("data") if resp.status_code == 200 else None
    except ValueError:
        data = None
    if not data or not isinstance(data, list) or "id" not in data[0]:
        raise BenchError(f"{base}/v1/models named no model (HTTP {resp.status_code}); pass --model")
    return data[0]["id"]


async def _probe(args: argparse.Namespace) -> str | None:
    import httpx

    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0), trust_env=False) as client:
        return await _ready_check(client, _base_url(args), args)


async def benchmark(args: argparse.Namespace, samples: list[SampleRequest]) -> dict:
    import httpx
    from tqdm.asyncio import tqdm

    base = _base_url(args)
    url = base + _endpoint(args)
    limit = args.max_concurrency or len(samples)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        model = args.served_model_name or args.model_id

        def build(sample: SampleRequest) -> dict:
            return build_payload(args.backend, model, sample, args.ignore_eos, args.temperature)

        print("Starting initial single prompt test run...")
        test = await send_request(client, url, build(samples[0]), samples[0])
        if not test.success:
            raise BenchError(
                f"the initial test request to {url} failed: {test.error} (check --backend, "
                "--endpoint and --model)"
            )
        print("Initial test run completed. Starting main benchmark run...")
        distribution = "Poisson process" if args.burstiness == 1.0 else "Gamma distribution"
        print(f"Traffic request rate: {args.request_rate}")
        print(f"Burstiness factor: {args.burstiness} ({distribution})")
        print(f"Maximum request concurrency: {args.max_concurrency}")
        offsets = arrival_offsets(len(samples), args.request_rate, args.burstiness, args.seed)
        gate = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        bar = None if args.disable_tqdm else tqdm(total=len(samples))

        async def one(sample: SampleRequest) -> RequestOutput:
            arrived = time.perf_counter()
            if gate is None:
                out = await send_request(client, url, build(sample), sample)
            else:
                async with gate:
                    out = await send_request(client, url, build(sample), sample)
            out.client_queue_time = out.start_time - arrived
            if bar is not None:
                bar.update(1)
            return out

        start = time.perf_counter()
        tasks = []
        for sample, offset in zip(samples, offsets, strict=True):
            wait = start + offset - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(one(sample)))
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        if bar is not None:
            bar.close()
    return {"outputs": outputs, "duration": duration}


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

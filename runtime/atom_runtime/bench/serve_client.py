"""`atom bench serve`'s client: one streaming request timed chunk by chunk, the arrival
process (Poisson or gamma gaps), the endpoint's ready check, and the run that sends every sample.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from atom_runtime.bench.serve_datasets import BenchError, SampleRequest, TokenSource

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


# -- the run -----------------------------------------------------------------------------------

WAITING_EVERY_S = 15.0  # how often the ready check says it is still waiting


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

    limit = max(args.ready_check_timeout_sec, 0)
    start = time.monotonic()
    said = None  # when "waiting" was last printed
    while True:
        try:
            resp = await client.get(f"{base}/v1/models")
            break
        except httpx.TransportError as e:
            waited = time.monotonic() - start
            if waited >= limit:
                raise BenchError(
                    f"cannot reach {base} after {waited:.0f} s: {type(e).__name__}: {e} (is the "
                    "server running? set --base-url or --host/--port; --ready-check-timeout-sec "
                    "waits longer)"
                ) from e
            if said is None or waited - said >= WAITING_EVERY_S:
                print(
                    f"waiting for the server at {base} ({waited:.0f} s; giving up after "
                    f"{limit} s, --ready-check-timeout-sec)",
                    file=sys.stderr,
                    flush=True,
                )
                said = waited
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

"""Disaggregation and routing benchmarks (issue 16, item 5), one GPU or CPU.

  transfer  KV pull throughput of the portable TCP connector (two connectors in this process over
            127.0.0.1, real KV tensors: device -> pinned host -> TCP -> pinned host -> device)
  serve     TTFT/TPOT p50/p99 under Poisson arrivals at several rates: aggregated (one engine
            behind `atom router`) vs disaggregated (a prefill and a decode engine side by side on
            the same GPU, `atom router` in front)
  routing   prefix-cache hit rate and TTFT of `--policy kv-aware` vs `round-robin` over two decode
            engines on a prefix-heavy trace (groups of requests sharing a long prefix)

python benchmarks/pd_bench.py transfer --out transfer.json
python benchmarks/pd_bench.py serve --model benchmarks/configs/qwen3-0.6b --rates 2,4,8,16 --out serve.json
python benchmarks/pd_bench.py routing --model benchmarks/configs/qwen3-0.6b --out routing.json

A model folder without tokenizer.json (the dummy configs in benchmarks/configs/) gets a synthetic
word-level tokenizer of the model's vocabulary in a scratch copy: prompts are token ids anyway.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from atom_runtime.bench.processes import AtomProcess

# One KV-transfer key for the whole run (docs/security.md): engines and routers read it from the
# environment; the transfer benchmark's connectors too.
KEY_ENV = {"ATOM_TRANSFER_KEY": secrets.token_hex(32)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(round(p / 100 * (len(v) - 1))))]


# -- transfer ------------------------------------------------------------------------------------


def bench_transfer(args) -> dict:
    os.environ.update(KEY_ENV)
    import torch

    from atom_runtime.kv_transfer.base import KVCacheAccess, RemoteBlocks
    from atom_runtime.kv_transfer.config import KVTransferConfig
    from atom_runtime.kv_transfer.tcp import TCPConnector

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    max_blocks = max(args.blocks)
    direct = False if args.staged else None  # None: direct on a CPU cache, staged on a GPU

    class Layer:
        def __init__(self) -> None:
            shape = (max_blocks, args.block_size, args.kv_heads, args.head_dim)
            self.k_cache = torch.randn(shape, device=device).to(dtype)
            self.v_cache = torch.randn(shape, device=device).to(dtype)

    def connector(role: str, port: int) -> TCPConnector:
        cfg = KVTransferConfig.from_cli(
            json.dumps(
                {
                    "kv_connector": "TCPConnector",
                    "kv_role": role,
                    "kv_ip": "127.0.0.1",
                    "kv_port": port,
                    "kv_connector_extra_config": {
                        "streams": args.streams,
                        "socket_buffer_bytes": args.socket_buffer_bytes,
                    },
                }
            )  # fmt: skip
        )
        kv = KVCacheAccess([Layer() for _ in range(args.layers)], direct=direct)
        return TCPConnector(cfg, kv)

    port = free_port()
    producer, consumer = connector("kv_producer", port), connector("kv_consumer", free_port())
    rows = []
    stop = threading.Event()

    def engine_loop() -> None:  # pure Python, as an engine loop between steps: holds the GIL
        x = 0
        while not stop.is_set():
            x += 1

    busy = threading.Thread(target=engine_loop, daemon=True)
    if args.gil_load:
        busy.start()
    try:
        for n in args.blocks:
            # The consumer writes into other blocks than the producer reads, in another order:
            # the gather and the scatter both see scattered block ids, as in serving.
            ids = list(range(n))
            into = list(range(max_blocks - 1, max_blocks - 1 - n, -1))
            times, cpu = [], []
            for r in range(args.repeat + 1):
                tid = f"bench-{n}-{r}"
                producer.offer(tid, ids)
                start, cpu0 = time.perf_counter(), time.process_time()
                consumer.start_pull(RemoteBlocks(tid, "127.0.0.1", port, ids), into, 120)
                results = []
                while not results:
                    consumer.wait(0.01)
                    results = consumer.completed()
                if results[0].error:
                    raise RuntimeError(results[0].error)
                if r:  # the first round warms the sockets and the staging buffers
                    times.append(time.perf_counter() - start)
                    cpu.append(time.process_time() - cpu0)
                while not producer.withdraw(tid):
                    time.sleep(0.001)  # the last stripe's ticket settles just after its bytes
            if args.check:
                for a, b in zip(producer.kv.caches, consumer.kv.caches, strict=True):
                    if not torch.equal(a[ids], b[into]):
                        raise RuntimeError(f"{n} blocks: the pulled bytes differ")
            nbytes = n * consumer.kv.block_bytes
            best, median = min(times), statistics.median(times)
            rows.append(
                {
                    "blocks": n,
                    "bytes": nbytes,
                    "seconds_best": best,
                    "seconds_median": median,
                    "gb_per_s_best": nbytes / best / 1e9,
                    "gb_per_s_median": nbytes / median / 1e9,
                    # Both ends' threads: the process's CPU seconds per GB moved.
                    "cpu_s_per_gb_median": statistics.median(cpu) / (nbytes / 1e9),
                }
            )
            print(
                f"{n:6d} blocks {nbytes / 2**20:9.1f} MiB  best {rows[-1]['gb_per_s_best']:6.2f} "
                f"median {rows[-1]['gb_per_s_median']:6.2f} GB/s  "
                f"{rows[-1]['cpu_s_per_gb_median']:5.2f} CPU s/GB"
            )
    finally:
        stop.set()
        if args.gil_load:
            busy.join()
        producer.close()
        consumer.close()
    return {
        "device": device,
        "gil_load": args.gil_load,
        "layout": consumer.kv.layout,
        "streams": args.streams,
        "direct": consumer.kv.direct,
        "socket_buffer_bytes": args.socket_buffer_bytes,
        "rows": rows,
    }


# -- processes -----------------------------------------------------------------------------------


def prepare_model(src: Path, scratch: Path) -> Path:
    """`src` itself when it has a tokenizer; else a copy with a word-level tokenizer."""
    if (src / "tokenizer.json").is_file() or src.is_file():
        return src
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = json.loads((src / "config.json").read_text())
    vocab = {f"t{i}": i for i in range(config["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    dst = scratch / f"{src.name}-served"
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "config.json", dst / "config.json")
    tok.save(str(dst / "tokenizer.json"))
    eos = config.get("eos_token_id", 0)
    eos = eos[0] if isinstance(eos, list) else eos
    (dst / "tokenizer_config.json").write_text(json.dumps({"eos_token": f"t{eos}"}))
    return dst


def engine(name, model: Path, args, scratch: Path, *extra: str) -> tuple[AtomProcess, str]:
    port, kv, replay = free_port(), free_port(), free_port()
    events = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{kv}",
              "replay_endpoint": f"tcp://127.0.0.1:{replay}", "topic": f"kv@{name}"}  # fmt: skip
    argv = ["--model", str(model), "--max-model-len", str(args.max_model_len),
            "--num-gpu-blocks-override", str(args.kv_blocks),
            "--kv-events-config", json.dumps(events), *args.engine_arg, *extra]  # fmt: skip
    if args.load_format:
        argv += ["--load-format", args.load_format]
    p = AtomProcess("serve", port, argv, scratch / f"{name}.log", env=KEY_ENV)
    return p, f"{p.url},kv-events={kv},kv-replay={replay}"


def router(name, scratch: Path, *args: str) -> AtomProcess:
    port = free_port()
    argv = ["--probe-interval", "0.5", *args]
    return AtomProcess("router", port, argv, scratch / f"{name}.log", env=KEY_ENV)


def transfer_config(role: str) -> str:
    return json.dumps({"kv_connector": "AtomPortableConnector", "kv_role": role,
                       "kv_ip": "127.0.0.1", "kv_port": free_port()})  # fmt: skip


def start(procs: list[AtomProcess]) -> None:
    for p in procs:
        p.wait_healthy(900)


# -- load ----------------------------------------------------------------------------------------


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt, max_tokens: int):
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    start = time.perf_counter()
    first = last = None
    n = 0
    usage = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": r.status_code}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                now = time.perf_counter()
                first = first or now
                last = now
                n += 1
    if first is None:
        return {"error": "no tokens"}
    out_tokens = (usage or {}).get("completion_tokens", n)
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "ttft": first - start,
        "tpot": (last - first) / (out_tokens - 1) if out_tokens > 1 else None,
        "e2e": last - start,
        "prompt_tokens": (usage or {}).get("prompt_tokens", len(prompt)),
        "cached_tokens": cached,
    }


async def poisson_load(url, model, prompts, rate, max_tokens, seed=0):
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None)) as c:
        tasks = []
        for p in prompts:
            tasks.append(asyncio.create_task(one_request(c, url, model, p, max_tokens)))
            await asyncio.sleep(rng.expovariate(rate) if rate > 0 else 0)
        return await asyncio.gather(*tasks)


def counters(url: str) -> dict[str, float]:
    """Every sample of `url`/metrics summed by name (labels folded), counters without `_total`."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            if family.type == "counter" and sample.name.endswith("_created"):
                continue
            for key in (name, *(f"{name}{{{v}}}" for k, v in sample.labels.items() if k == "path")):
                out[key] = out.get(key, 0.0) + sample.value
    return out


# What each row reports from the processes' own metrics (differences over the row).
WATCHED = {
    "router": ["atom:router_decisions{local_prefill}", "atom:router_decisions{remote_prefill}",
               "atom:router_fallbacks", "atom:router_prompt_tokens",
               "atom:router_prefix_matched_tokens"],
    "decode": ["atom:prompt_tokens", "atom:prefix_cache_hits", "atom:kv_transfer_pulls",
               "atom:kv_transfer_blocks_received", "atom:kv_transfer_bytes_received",
               "atom:kv_transfer_blocks_local_hit", "atom:kv_transfer_fallbacks"],
    "prefill": ["atom:prompt_tokens", "atom:kv_transfer_blocks_sent",
                "atom:kv_transfer_hold_timeouts"],
}  # fmt: skip


def snapshot(procs: dict[str, AtomProcess]) -> dict[str, dict[str, float]]:
    return {role: counters(p.url) for role, p in procs.items()}


def delta(before: dict, after: dict) -> dict[str, float]:
    """The watched counters' growth between two snapshots, as `role:metric` keys."""
    out = {}
    for role, names in WATCHED.items():
        if role not in after:
            continue
        for name in names:
            grown = after[role].get(name, 0.0) - before[role].get(name, 0.0)
            out[f"{role}:{name}"] = grown
    return out


def summarize(results: list[dict]) -> dict:
    ok = [r for r in results if "error" not in r]
    ttft = [r["ttft"] for r in ok]
    tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
    prompt = sum(r["prompt_tokens"] for r in ok)
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "ttft_p50_ms": 1e3 * pct(ttft, 50) if ttft else None,
        "ttft_p99_ms": 1e3 * pct(ttft, 99) if ttft else None,
        "tpot_p50_ms": 1e3 * pct(tpot, 50) if tpot else None,
        "tpot_p99_ms": 1e3 * pct(tpot, 99) if tpot else None,
        "cache_hit_rate": sum(r["cached_tokens"] for r in ok) / prompt if prompt else None,
    }


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


def vocab_of(model: Path) -> int:
    folder = model if model.is_dir() else model.parent
    return min(json.loads((folder / "config.json").read_text())["vocab_size"], 32000)


def bench_serve(args, scratch: Path) -> dict:
    model = prepare_model(Path(args.model), scratch)
    name = str(model)
    out = {"input_len": args.input_len, "output_len": args.output_len, "rows": []}
    for mode in args.modes:
        procs: list[AtomProcess] = []
        try:
            if mode == "aggregated":
                e, backend = engine("agg", model, args, scratch)
                procs.append(e)
                start(procs)
                r = router("router-agg", scratch, "--backend", backend)
                roles = {"decode": e}
            else:
                p, _ = engine("prefill", model, args, scratch,
                              "--kv-transfer-config", transfer_config("kv_producer"))  # fmt: skip
                procs.append(p)
                start(procs)  # one at a time: both profile the same GPU
                d, backend = engine("decode", model, args, scratch,
                                    "--kv-transfer-config", transfer_config("kv_consumer"))  # fmt: skip
                procs.append(d)
                start(procs)
                r = router("router-pd", scratch, "--backend", backend, "--prefill-backend", p.url,
                           "--remote-prefill-threshold", str(args.threshold))  # fmt: skip
                roles = {"decode": d, "prefill": p}
            procs.append(r)
            start(procs)
            warm = random_prompts(4, args.input_len, vocab_of(model), seed=99)
            asyncio.run(poisson_load(r.url, name, warm, 0, 4))
            roles["router"] = r
            for i, rate in enumerate(args.rates):
                prompts = random_prompts(args.num_requests, args.input_len, vocab_of(model), i)
                before = snapshot(roles)
                t0 = time.perf_counter()
                results = asyncio.run(poisson_load(r.url, name, prompts, rate, args.output_len))
                row = {"mode": mode, "rate": rate, "seconds": time.perf_counter() - t0,
                       **summarize(results), "counters": delta(before, snapshot(roles))}  # fmt: skip
                out["rows"].append(row)
                print(json.dumps(row))
        finally:
            for p in reversed(procs):
                p.stop()
    return out


async def closed_loop(url: str, model: str, prompts: list, args) -> list[dict]:
    sem = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(timeout=None) as c:

        async def go(p):
            async with sem:
                return await one_request(c, url, model, p, args.output_len)

        return await asyncio.gather(*(go(p) for p in prompts))


def bench_routing(args, scratch: Path) -> dict:
    model = prepare_model(Path(args.model), scratch)
    name = str(model)
    vocab = vocab_of(model)
    rng = random.Random(0)
    prefixes = random_prompts(args.groups, args.prefix_len, vocab, seed=7)
    trace = []
    for _ in range(args.num_requests):
        g = rng.randrange(args.groups)
        trace.append(prefixes[g] + [rng.randrange(10, vocab) for _ in range(args.suffix_len)])
    out = {"groups": args.groups, "prefix_len": args.prefix_len, "rows": []}
    for policy in args.policies:
        procs: list[AtomProcess] = []
        try:
            backends = []
            for k in range(2):
                e, backend = engine(f"decode{k}-{policy}", model, args, scratch)
                procs.append(e)
                start(procs)
                backends += ["--backend", backend]
            r = router(f"router-{policy}", scratch, *backends, "--policy", policy)
            procs.append(r)
            start(procs)
            roles = {"router": r}
            before = snapshot(roles)
            t0 = time.perf_counter()
            results = asyncio.run(closed_loop(r.url, name, trace, args))
            row = {"policy": policy, "seconds": time.perf_counter() - t0, **summarize(results),
                   "counters": delta(before, snapshot(roles))}  # fmt: skip
            out["rows"].append(row)
            print(json.dumps(row))
        finally:
            for p in reversed(procs):
                p.stop()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("transfer")
    t.add_argument("--layers", type=int, default=28)  # Qwen3-0.6B's geometry by default
    t.add_argument("--kv-heads", type=int, default=8)
    t.add_argument("--head-dim", type=int, default=128)
    t.add_argument("--block-size", type=int, default=16)
    t.add_argument("--dtype", default="bfloat16")
    t.add_argument("--blocks", type=lambda s: [int(x) for x in s.split(",")],
                   default=[16, 64, 256, 1024])  # fmt: skip
    t.add_argument("--repeat", type=int, default=5)
    t.add_argument("--streams", type=int, default=4, help="payload connections per pull")
    t.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    t.add_argument("--staged", action="store_true",
                   help="a CPU cache through staging buffers too (default: sockets on the blocks)")  # fmt: skip
    t.add_argument("--socket-buffer-bytes", type=int, default=0, help="0: kernel autotuning")
    t.add_argument("--check", action="store_true", help="compare the pulled bytes")
    t.add_argument("--gil-load", action="store_true",
                   help="a thread spinning Python meanwhile, as a busy engine loop")  # fmt: skip
    for name in ("serve", "routing"):
        s = sub.add_parser(name)
        s.add_argument("--model", default="benchmarks/configs/qwen3-0.6b")
        s.add_argument("--load-format", default="dummy")
        s.add_argument("--kv-blocks", type=int, default=16384)
        s.add_argument("--max-model-len", type=int, default=8192)
        s.add_argument("--output-len", type=int, default=128 if name == "serve" else 8)
        s.add_argument("--engine-arg", action="append", default=[],
                       help="extra `atom serve` argument (repeat)")  # fmt: skip
    s = sub.choices["serve"]
    s.add_argument("--modes", type=lambda v: v.split(","), default=["aggregated", "disaggregated"])
    s.add_argument("--rates", type=lambda v: [float(x) for x in v.split(",")],
                   default=[2.0, 4.0, 8.0, 16.0])  # fmt: skip
    s.add_argument("--num-requests", type=int, default=128)
    s.add_argument("--input-len", type=int, default=2048)
    s.add_argument("--threshold", type=int, default=256)
    r = sub.choices["routing"]
    r.add_argument("--policies", type=lambda v: v.split(","), default=["kv-aware", "round-robin"])
    r.add_argument("--groups", type=int, default=16)
    r.add_argument("--prefix-len", type=int, default=2048)
    r.add_argument("--suffix-len", type=int, default=64)
    r.add_argument("--num-requests", type=int, default=256)
    r.add_argument("--concurrency", type=int, default=16)
    for p in sub.choices.values():
        p.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="pd-bench-"))
    print(f"logs in {scratch}", file=sys.stderr)
    if args.cmd == "transfer":
        result = bench_transfer(args)
    elif args.cmd == "serve":
        result = bench_serve(args, scratch)
    else:
        result = bench_routing(args, scratch)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())

"""Disaggregation and routing benchmarks (issue 16, item 5), one GPU or CPU.

  transfer  KV pull throughput of a connector (pd_transfer.py: two connectors in this process over
            127.0.0.1, real KV tensors): `--connector tcp` (device -> pinned host -> TCP ->
            pinned host -> device) or `--connector nixl` (one-sided NIXL READ, VRAM to VRAM)
  serve     TTFT/TPOT p50/p99 under Poisson arrivals at several rates: aggregated (one engine
            behind `atom router`) vs disaggregated (a prefill and a decode engine side by side on
            the same GPU, `atom router` in front) over the TCP connector (`disaggregated`) or
            NIXL (`disaggregated-nixl`)
  routing   prefix-cache hit rate and TTFT of `--policy kv-aware` vs `round-robin` over two decode
            engines on a prefix-heavy trace (groups of requests sharing a long prefix)

python benchmarks/pd_bench.py transfer --out transfer.json
python benchmarks/pd_bench.py transfer --connector nixl --check --out transfer-nixl.json
python benchmarks/pd_bench.py serve --model benchmarks/configs/qwen3-0.6b --rates 2,4,8,16 --out serve.json
python benchmarks/pd_bench.py serve --modes aggregated,disaggregated,disaggregated-nixl ...
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
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx
from pd_transfer import KEY_ENV, add_transfer_args, bench_transfer, free_port

from atom_runtime.bench.processes import AtomProcess

# What `serve --modes` names: the disaggregated modes and their connectors.
CONNECTORS = {"disaggregated": "AtomPortableConnector", "disaggregated-nixl": "NixlConnector"}


def pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(round(p / 100 * (len(v) - 1))))]


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


def transfer_config(role: str, connector: str = "AtomPortableConnector") -> str:
    return json.dumps({"kv_connector": connector, "kv_role": role,
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
                connector = CONNECTORS[mode]
                p, _ = engine("prefill", model, args, scratch, "--kv-transfer-config",
                              transfer_config("kv_producer", connector))  # fmt: skip
                procs.append(p)
                start(procs)  # one at a time: both profile the same GPU
                d, backend = engine("decode", model, args, scratch, "--kv-transfer-config",
                                    transfer_config("kv_consumer", connector))  # fmt: skip
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
    add_transfer_args(sub.add_parser("transfer"))
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
    bad = [m for m in getattr(args, "modes", []) if m != "aggregated" and m not in CONNECTORS]
    if args.cmd == "serve" and bad:
        ap.error(f"--modes: unknown {bad}; known: aggregated, {', '.join(CONNECTORS)}")
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

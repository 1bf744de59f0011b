"""Where the HTTP path's CPU goes (W4 at saturation): CPU time per streamed output token of the
API server and of the engine core, with the output rate, against `LLM.generate` offline.

Starts `atom serve` (dummy weights) on 127.0.0.1 as a subprocess, sends W1-shaped requests all at
once (lengths uniform in [--input-len-min, --input-len-max], --output-len tokens each, greedy,
EOS ignored, streaming `/v1/completions` with usage), and reads each server process's CPU time
from /proc before and after the run: on a shared machine that is the robust figure, wall time
is not (the client competes for the same cores; `--client-procs` spreads it over several
processes, so that on a big machine it does not cap the rate). The server is stopped in a
`finally`.

    # CPU box: a tiny model makes the engine fast enough that the API server's cost dominates
    OMP_NUM_THREADS=1 python benchmarks/serve_cpu_cost.py --tiny --offline
    # the GPU box: W1 itself
    python benchmarks/serve_cpu_cost.py --model benchmarks/configs/qwen3-0.6b --offline

A model folder without tokenizer.json (dummy-weight configs) is served from a scratch copy with a
synthetic byte-level BPE tokenizer of the model's vocabulary size (`synthetic_tokenizer`):
detokenization then costs what a real byte-level tokenizer costs, multi-byte characters split
across tokens included. `--mode nonstream` and `--n` check that
non-streamed and n > 1 requests keep up too. `--py-spy DIR` records both server processes with
py-spy during the run (installed separately: `pip install py-spy`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from atom_runtime.bench import serve_client as bsc
from atom_runtime.bench import serve_datasets as bsd
from atom_runtime.bench.cli import _clip_vocab, w1_prompts

ATOM = [sys.executable, "-m", "atom_runtime"]
SPY_RATE = int(os.environ.get("ATOM_PY_SPY_RATE", "250"))  # samples a second
TICKS = os.sysconf("SC_CLK_TCK")


# -- the model folder ------------------------------------------------------------------------------


def tiny_config(hidden: int, layers: int, vocab: int) -> dict:
    """A Qwen3-shaped config small enough that a CPU produces tokens at a GPU's pace."""
    heads = max(1, hidden // 32)
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": hidden * 3,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> character map, which byte-level BPE vocabularies are written in."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def synthetic_tokenizer(vocab: int, seed: int = 0):
    """A byte-level BPE tokenizer of `vocab` ids, made up from `seed`: the 256 single bytes, then
    pieces like a real vocabulary's: mostly ASCII words (often after a space), some pieces of
    multi-byte characters (accents, CJK, emoji) cut at any byte, so a character can take several
    tokens. A dummy model samples any id; detokenizing then costs what it costs with a real
    byte-level tokenizer (a tokenizers.Tokenizer, decoded by its Rust decoder)."""
    import random
    import string

    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    rng = random.Random(seed)
    alphabet = _byte_alphabet()
    wide = "éüñçøßàœ漢字語文本日本東京😀👍🏽🚀✓—“”"
    pieces = {bytes([b]) for b in range(256)}
    while len(pieces) < vocab:
        if rng.random() < 0.85:
            word = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(1, 8)))
            piece = ((" " if rng.random() < 0.6 else "") + word).encode()
        else:
            raw = "".join(rng.choices(wide, k=3)).encode()
            start = rng.randrange(len(raw))
            piece = raw[start : start + rng.randint(1, 4)]
        pieces.add(piece)
    ordered = sorted(pieces, key=lambda p: (len(p) > 1, rng.random()))[:vocab]
    table = {"".join(alphabet[b] for b in p): i for i, p in enumerate(ordered)}
    hf = HFTokenizer(models.BPE(vocab=table, merges=[]))
    hf.decoder = decoders.ByteLevel()
    return hf


def model_folder(args: argparse.Namespace, scratch: Path) -> tuple[Path, str]:
    """The folder to serve, with a tokenizer; returns it and what tokenizer it carries."""
    if args.tiny:
        config = tiny_config(args.tiny_hidden, args.tiny_layers, args.tiny_vocab)
    else:
        src = Path(args.model)
        if (src / "tokenizer.json").is_file():
            return src, "the model's own"
        config = json.loads((src / "config.json").read_text())
    dst = scratch / "model"
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(config))
    synthetic_tokenizer(config["vocab_size"]).save(str(dst / "tokenizer.json"))
    return dst, "synthetic byte-level BPE"


# -- processes and their CPU time ------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def children(pid: int) -> dict[int, str]:
    """Direct children of `pid`: pid -> command line (the process title, once set)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
                out[int(entry.name)] = cmd
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue
    return out


def engine_core_pid(api_pid: int) -> int:
    for pid, cmd in children(api_pid).items():
        if cmd.startswith("ATOM::EngineCore"):
            return pid
    raise RuntimeError(f"no ATOM::EngineCore child of {api_pid}")


def start_server(args: argparse.Namespace, model: Path, port: int, log_path: Path):
    cmd = [
        *ATOM,
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--model",
        str(model),
        "--load-format",
        "dummy",
        "--disable-log-requests",
        "--max-num-seqs",
        str(args.max_num_seqs),
        *args.serve_arg,
    ]
    with log_path.open("w") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_healthy(proc: subprocess.Popen, base: str, log_path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"atom serve exited {proc.returncode}:\n{log_path.read_text()}")
        try:
            if httpx.get(f"{base}/health", timeout=2, trust_env=False).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"atom serve not healthy after {timeout:.0f} s:\n{log_path.read_text()}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever of its group is left
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


# -- the load --------------------------------------------------------------------------------------


async def nonstream_request(client, url: str, body: dict, sample) -> bsc.RequestOutput:
    out = bsc.RequestOutput(prompt_len=sample.prompt_len)
    body = {**body, "stream": False}
    body.pop("stream_options", None)
    out.start_time = start = time.perf_counter()
    try:
        resp = await client.post(url, json=body)
        out.latency = out.ttft = time.perf_counter() - start
        if resp.status_code != 200:
            out.error = f"HTTP {resp.status_code}: {resp.text[:500]}"
            return out
        out.output_tokens = resp.json()["usage"]["completion_tokens"]
        out.success = True
    except Exception as e:  # a failure counts against this request only
        out.error = f"{type(e).__name__}: {e}"
    return out


async def run_load(base: str, model: str, samples, args, go=None) -> list[bsc.RequestOutput]:
    """Send every sample at once (after `go` is set, when given) and wait for all answers."""
    url = base + "/v1/completions"
    limits = httpx.Limits(max_connections=len(samples), max_keepalive_connections=len(samples))
    timeout = httpx.Timeout(args.request_timeout, connect=60.0)
    send = bsc.send_request if args.mode == "stream" else nonstream_request
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:

        def body(sample) -> dict:
            b = bsc.build_payload("openai", model, sample, ignore_eos=True, temperature=0.0)
            if args.n > 1:
                b.update(n=args.n, temperature=1.0, seed=0)
            return b

        if go is not None:
            await asyncio.to_thread(go.wait)
        return await asyncio.gather(*(send(client, url, body(s), s) for s in samples))


def _client_process(base: str, model: str, samples, args, ready, go, results) -> None:
    ready.set()
    results.put(asyncio.run(run_load(base, model, samples, args, go)))


def timed_load(base: str, model: str, samples, args, pids: list[int]):
    """The load, from `--client-procs` processes (at saturation one Python client needs most of a
    core, ~27 us a chunk: it must not be what caps the rate). Returns the outputs, the wall
    time and each of `pids`' CPU seconds, all measured from the moment every client is ready."""
    procs = []
    if args.client_procs > 1:
        ctx = mp.get_context("spawn")
        go, results = ctx.Event(), ctx.Queue()
        shards = [samples[i :: args.client_procs] for i in range(args.client_procs)]
        ready = [ctx.Event() for _ in shards]
        procs = [
            ctx.Process(target=_client_process, args=(base, model, shard, args, r, go, results))
            for shard, r in zip(shards, ready, strict=True)
        ]
        for proc in procs:
            proc.start()
        for r in ready:
            r.wait()
        time.sleep(1.0)  # their event loops are up and waiting for `go`
    cpu0 = [cpu_seconds(pid) for pid in pids]
    t0 = time.perf_counter()
    if procs:
        go.set()
        outs = [o for _ in procs for o in results.get()]
        for proc in procs:
            proc.join()
    else:
        outs = asyncio.run(run_load(base, model, samples, args))
    wall = time.perf_counter() - t0
    return outs, wall, [cpu_seconds(pid) - c for pid, c in zip(pids, cpu0, strict=True)]


def pct(values: list[float], p: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(round(p / 100 * (len(v) - 1))))] if v else float("nan")


def serve_run(args: argparse.Namespace, model: Path, prompts: list[list[int]]) -> dict:
    port = args.port or _free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = Path(args.scratch) / "serve.log"
    proc = start_server(args, model, port, log_path)
    spies: list[subprocess.Popen] = []
    try:
        wait_healthy(proc, base, log_path, args.startup_timeout)
        core = engine_core_pid(proc.pid)
        name = str(model)
        warm = [bsd.SampleRequest(p[:32], 32, 16) for p in prompts[: min(16, len(prompts))]]
        asyncio.run(run_load(base, name, warm, args))  # first-time costs stay out of the figures
        samples = [bsd.SampleRequest(p, len(p), args.output_len) for p in prompts]
        if args.py_spy:
            spies = start_py_spy(args.py_spy, {"api_server": proc.pid, "engine_core": core})
        outs, wall, (api_cpu, core_cpu) = timed_load(base, name, samples, args, [proc.pid, core])
    finally:
        for spy in spies:
            spy.send_signal(signal.SIGINT)
        for spy in spies:
            spy.wait(60)
        stop_server(proc)
    failed = [o for o in outs if not o.success]
    if failed:
        raise RuntimeError(f"{len(failed)} request(s) failed, first: {failed[0].error}")
    tokens = sum(o.output_tokens for o in outs)
    itls = [g for o in outs for g in o.itl]
    ttfts = [o.ttft for o in outs]
    # Gaps once every request has its first token: prefill chunks no longer share the engine's
    # steps, so these show the decode step plus whatever the API server adds.
    all_started = max(o.start_time + o.ttft for o in outs)
    steady = []
    for o in outs:
        at = o.start_time + o.ttft
        for gap in o.itl:
            at += gap
            if at - gap >= all_started:
                steady.append(gap)
    chunks = sum(len(o.itl) + 1 for o in outs) if args.mode == "stream" else len(outs)
    return {
        "requests": len(outs),
        "output_tokens": tokens,
        "chunks": chunks,
        "wall_s": wall,
        "output_tok_per_s": tokens / wall,
        "api_server_cpu_s": api_cpu,
        "engine_core_cpu_s": core_cpu,
        "api_server_us_per_token": api_cpu / tokens * 1e6,
        "engine_core_us_per_token": core_cpu / tokens * 1e6,
        "ttft_p50_ms": pct(ttfts, 50) * 1e3,
        "ttft_p99_ms": pct(ttfts, 99) * 1e3,
        "itl_p50_ms": pct(itls, 50) * 1e3,
        "itl_p99_ms": pct(itls, 99) * 1e3,
        "itl_mean_ms": statistics.fmean(itls) * 1e3 if itls else float("nan"),
        "steady_itl_p50_ms": pct(steady, 50) * 1e3,
        "steady_itl_p99_ms": pct(steady, 99) * 1e3,
    }


def start_py_spy(folder: str, pids: dict[str, int]) -> list[subprocess.Popen]:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    Path(folder).mkdir(parents=True, exist_ok=True)
    return [
        subprocess.Popen(
            [
                spy,
                "record",
                "--pid",
                str(pid),
                "--rate",
                str(SPY_RATE),
                "--nonblocking",
                "--format",
                "raw",
                "--output",
                str(Path(folder) / f"{role}.txt"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        for role, pid in pids.items()
    ]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- offline ---------------------------------------------------------------------------------------


def offline_run(args: argparse.Namespace, model: Path, prompts: list[list[int]]) -> dict:
    """The same requests through `LLM.generate` in this process: engine + output processor."""
    from atom_runtime.llm import LLM
    from atom_runtime.sampling_params import SamplingParams

    extra = _engine_kwargs(args.serve_arg)
    llm = LLM(str(model), load_format="dummy", max_num_seqs=args.max_num_seqs, **extra)
    try:
        llm.generate([{"prompt_token_ids": prompts[0][:16]}], SamplingParams(max_tokens=4),
                     use_tqdm=False)  # fmt: skip
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        cpu, t0 = time.process_time(), time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu
    finally:
        llm.shutdown()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "output_tokens": tokens,
        "wall_s": wall,
        "output_tok_per_s": tokens / wall,
        "process_us_per_token": cpu / tokens * 1e6,
    }


def _engine_kwargs(serve_args: list[str]) -> dict:
    """The engine flags among --serve-arg, as LLM keyword arguments."""
    from atom_runtime.config import EngineConfig
    from atom_runtime.engine_args import add_engine_arguments

    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    known, _ = p.parse_known_args(["--model", "x", *serve_args])
    config = EngineConfig.from_args(known)
    given = {a.lstrip("-").split("=")[0].replace("-", "_") for a in serve_args if a[:2] == "--"}
    return {k: v for k, v in vars(config).items() if k in given and k != "model"}


# -- main ------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="benchmarks/configs/qwen3-0.6b")
    ap.add_argument("--tiny", action="store_true", help="serve a tiny Qwen3-shaped model instead")
    ap.add_argument("--tiny-hidden", type=int, default=64)
    ap.add_argument("--tiny-layers", type=int, default=2)
    ap.add_argument("--tiny-vocab", type=int, default=4096)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len-min", type=int, default=100)
    ap.add_argument("--input-len-max", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--mode", choices=["stream", "nonstream"], default="stream")
    ap.add_argument("--n", type=int, default=1, help="choices per request (sampled, seeded)")
    ap.add_argument("--offline", action="store_true", help="also run LLM.generate on the same")
    ap.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        help="an extra `atom serve` argument (repeat; e.g. --serve-arg=--dtype=float32)",
    )
    ap.add_argument(
        "--client-procs",
        type=int,
        default=max(1, min(4, (os.cpu_count() or 1) // 4)),
        help="client processes the requests are shared among (default: a quarter of the cores, "
        "at most 4)",
    )
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--request-timeout", type=float, default=3600.0)
    ap.add_argument("--py-spy", metavar="DIR", help="record both server processes with py-spy")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="atom-serve-cpu-") as scratch:
        args.scratch = scratch
        model, tokenizer = model_folder(args, Path(scratch))
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        prompts = _clip_vocab(
            w1_prompts(args.num_prompts, args.input_len_min, args.input_len_max), vocab
        )
        print(f"model {args.model if not args.tiny else 'tiny'} ({tokenizer} tokenizer), "
              f"{len(prompts)} requests x {args.output_len} tokens, {args.mode}, n={args.n}")  # fmt: skip
        result = {"argv": sys.argv[1:], "tokenizer": tokenizer}
        result["serve"] = s = serve_run(args, model, prompts)
        print(
            f"serve: {s['output_tokens']} tokens in {s['wall_s']:.2f} s = "
            f"{s['output_tok_per_s']:,.0f} tok/s ({s['chunks']} chunks); CPU per token: "
            f"API server {s['api_server_us_per_token']:.1f} us, engine core "
            f"{s['engine_core_us_per_token']:.1f} us; TTFT p50/p99 {s['ttft_p50_ms']:.0f}/"
            f"{s['ttft_p99_ms']:.0f} ms; chunk gap p50/p99 {s['itl_p50_ms']:.1f}/"
            f"{s['itl_p99_ms']:.1f} ms ({s['steady_itl_p50_ms']:.1f}/{s['steady_itl_p99_ms']:.1f} "
            "once every request has its first token)"
        )
        if args.offline:
            result["offline"] = o = offline_run(args, model, prompts)
            print(
                f"offline: {o['output_tokens']} tokens in {o['wall_s']:.2f} s = "
                f"{o['output_tok_per_s']:,.0f} tok/s ({o['process_us_per_token']:.1f} us CPU "
                f"per token); serve/offline = {s['output_tok_per_s'] / o['output_tok_per_s']:.0%}"
            )
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

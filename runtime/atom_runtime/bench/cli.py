"""`atom bench throughput|latency|prefix|serve`: the workloads of shared/BENCHMARKS.md, with an
optional peer (Hugging Face transformers) measured in the same run.

    atom bench throughput --load-format dummy --model benchmarks/configs/qwen3-0.6b   # W1
    atom bench latency --load-format dummy --model benchmarks/configs/llama-3.1-8b    # W2
    atom bench prefix --load-format dummy --model benchmarks/configs/qwen3-0.6b       # W3
    atom bench serve --base-url http://127.0.0.1:8000 --dataset-name sharegpt         # W4
    atom bench startup --dir /local/nvme/atom-startup   # weight loading and time to healthy

W1 and W2 also print their bandwidth bound, from the bytes the engine's decode steps must move
(bench_bound.py), at the device's peak and its measured copy bandwidth. `serve` is a client
(bench/serve.py) and never imports torch; `prefix` lives in bench/prefix.py.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from collections.abc import Callable

from atom_runtime.bench import bound as bench_bound
from atom_runtime.bench import speculative as bench_spec
from atom_runtime.config import EngineConfig
from atom_runtime.engine_args import add_engine_arguments
from atom_runtime.system.flag_table import add_number_flags
from atom_runtime.system.process import LOG_FORMAT, LOG_LEVELS, log_level


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="workload", required=True)
    tp = sub.add_parser("throughput", help="W1: offline throughput (output tokens/s)")
    add_number_flags(
        tp,
        num_prompts=256,
        input_len_min=100,
        input_len_max=1024,
        output_len=512,
        peer_batch_size=64,
    )
    tp.add_argument(
        "--peer-num-prompts",
        type=int,
        default=None,
        help="prompts for the peer (default: all; the peer is slow)",
    )
    lat = sub.add_parser("latency", help="W2: single-stream decode latency (ms/token)")
    add_number_flags(lat, input_len=128, output_len=256, iters=3)
    lat.add_argument(
        "--peer-cache",
        choices=["auto", "static", "dynamic"],
        default="auto",
        help="the peer's KV cache: static (compiled decode, transformers' fastest single "
        "stream) or dynamic (its default); auto: static, but dynamic for hybrid models, whose "
        "static-cache compile did not finish in minutes on the H200",
    )
    bench_spec.add_arguments(lat)  # W7
    for p in (tp, lat):
        p.add_argument("--peer", choices=["none", "transformers"], default="none")
        p.add_argument("--output-json", default=None)
        add_engine_arguments(p)
    from atom_runtime.bench import multiturn as bench_multiturn
    from atom_runtime.bench import prefix as bench_prefix
    from atom_runtime.bench import serve as bench_serve

    pre = sub.add_parser("prefix", help="W3: TTFT over a cached shared prefix vs caching off")
    bench_prefix.add_arguments(pre)
    add_engine_arguments(pre)
    serve = sub.add_parser("serve", help="W4: drive an OpenAI-compatible server (vllm bench serve)")
    bench_serve.add_arguments(serve)
    bench_multiturn.add_parser(sub)  # W5
    from atom_runtime.bench import startup as bench_startup

    start = sub.add_parser("startup", help="weight loading GB/s and time to healthy, per format")
    bench_startup.add_arguments(start)
    for name, p in sub.choices.items():
        if name != "startup":
            p.add_argument(
                "--log-level",
                type=log_level,
                default="warning",
                choices=LOG_LEVELS,
                help="log level on stderr, any case",
            )


def w1_prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    """W1's prompts: lengths uniform in [lo, hi], token ids in [100, 150000), Random(seed)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        length = rng.randint(lo, hi)
        prompts.append([rng.randrange(100, 150000) for _ in range(length)])
    return prompts


def _clip_vocab(prompts: list[list[int]], vocab: int) -> list[list[int]]:
    return [[t % vocab for t in p] for p in prompts]


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    if args.workload == "serve":
        from atom_runtime.bench import serve as bench_serve

        return bench_serve.run(args)
    if args.workload == "startup":
        from atom_runtime.bench import startup as bench_startup

        return bench_startup.run(args)
    # The offline workloads run the engine in this process: on a machine without a GPU they run
    # on CPU (slowly; figures not comparable with BENCHMARKS.md), and any failure is one line.
    try:
        problem = _device_problem(args)
        if problem:
            print(f"atom bench {args.workload}: error: {problem}", file=sys.stderr)
            return 1
        if args.workload == "prefix":
            from atom_runtime.bench import prefix as bench_prefix

            return bench_prefix.run(args)
        if args.workload == "multiturn":
            from atom_runtime.bench import multiturn as bench_multiturn

            return bench_multiturn.run(args)
        return _run_offline(args)
    except (ValueError, FileNotFoundError, ImportError, RuntimeError, OSError) as e:
        print(f"atom bench {args.workload}: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


def _device_problem(args: argparse.Namespace) -> str | None:
    """Why this machine cannot run the asked-for device, or None; prints a note when the run
    falls back to CPU."""
    import torch

    has_gpu = torch.cuda.is_available()
    if args.device.startswith("cuda") and not has_gpu:
        return (
            f"--device {args.device}: no CUDA or ROCm GPU is visible here (torch "
            f"{torch.__version__}); use --device cpu or --device auto"
        )
    if getattr(args, "peer", "none") == "transformers":
        try:
            import transformers  # noqa: F401
        except ImportError:
            return "--peer transformers: the transformers package is not installed"
    if not has_gpu and args.device in ("auto", "cpu") and not getattr(args, "admission_only", 0):
        print(
            f"atom bench {args.workload}: no GPU here, running on CPU; the figures are not "
            "comparable with the GPU ones in docs/benchmarks.md (use small sizes)",
            file=sys.stderr,
        )
    return None


def _run_offline(args: argparse.Namespace) -> int:
    import torch

    from atom_runtime.llm import LLM

    config = EngineConfig.from_args(args)
    kwargs = {k: v for k, v in vars(config).items() if k != "model"}
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result: dict = {
        "workload": args.workload,
        "model": config.model,
        "device": device,
        "date": time.strftime("%Y-%m-%d"),
        "argv": sys.argv[1:],
    }
    if getattr(args, "spec_cost_sweep", False) and config.speculative_config is None:
        raise ValueError("--spec-cost-sweep: needs --speculative-config (the drafter to time)")
    if getattr(args, "prompt_set", "random") == "copy":
        return _run_copy_prompts(config, args, result)
    llm = LLM(config.model, **kwargs)
    runner = getattr(llm.engine.executor, "runner", llm.engine.executor)
    result["resident_weights"] = bench_bound.resident_weights(runner.model)
    print("atom  " + bench_bound.describe_weights(result["resident_weights"]))
    # Which kernel each group of batch-1 projections took at start-up (GPU only).
    one_row = dict(getattr(getattr(llm.engine, "executor", None), "small_m_kernels", None) or {})
    if one_row:
        result["one_row_paths"] = one_row
        print("atom  one-row paths: " + ", ".join(f"{k} {v}" for k, v in one_row.items()))
    few = dict(getattr(getattr(llm.engine, "executor", None), "few_row_kernels", None) or {})
    if few:  # speculative decoding: the verify step's projections
        result["few_row_paths"] = few
        print("atom  few-row paths: " + ", ".join(f"{k} {v}" for k, v in few.items()))
    run = run_throughput if args.workload == "throughput" else run_latency
    peer_run = run(llm, args, result)
    if args.peer == "transformers":
        llm.shutdown()  # the peer gets the device to itself
        del llm
        _free()
        peer_run(llm_model_path(config))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def _run_copy_prompts(config: EngineConfig, args: argparse.Namespace, result: dict) -> int:
    """W7's real-acceptance run: copy-heavy prompts without and with --speculative-config."""
    from atom_runtime.llm import LLM

    if config.speculative_config is None:
        raise ValueError("--prompt-set copy: needs --speculative-config (it compares the two)")
    kwargs = {k: v for k, v in vars(config).items() if k != "model"}

    def make_llm(spec: bool):
        return LLM(config.model, **{**kwargs, "speculative_config": kwargs["speculative_config"]
                                    if spec else None})  # fmt: skip

    bench_spec.run_copy_prompts(make_llm, args, result)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def run_throughput(llm, args: argparse.Namespace, result: dict) -> Callable[[str], None]:
    """W1: every prompt at once; output tokens per second and the bound. Returns the peer's run
    of the same prompts, for after the engine is shut down."""
    from atom_runtime.sampling_params import SamplingParams

    vocab = llm.engine.model_config.vocab_size
    prompts = _clip_vocab(
        w1_prompts(args.num_prompts, args.input_len_min, args.input_len_max), vocab
    )
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(
        [{"prompt_token_ids": prompts[0][:16]}], SamplingParams(max_tokens=4), use_tqdm=False
    )  # warm-up
    _sync()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    _sync()
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    result.update(
        num_prompts=len(prompts),
        output_tokens=tokens,
        seconds=elapsed,
        output_tokens_per_s=tokens / elapsed,
        preemptions=llm.engine.scheduler.num_preemptions,
    )
    print(f"atom  W1: {tokens} output tokens in {elapsed:.2f}s = {tokens / elapsed:,.0f} tok/s")
    bench_spec.report_acceptance(llm, result)
    result["bound"] = bench_bound.report(
        llm.engine,
        "throughput",
        result["output_tokens_per_s"],
        prompt_lens=[len(p) for p in prompts],
        output_len=args.output_len,
    )
    print(bench_bound.describe("throughput", result["bound"]))

    def peer_run(model_path: str) -> None:
        n = args.peer_num_prompts or len(prompts)
        peer = peer_throughput(model_path, prompts[:n], args.output_len, args.peer_batch_size)
        result["peer"] = peer
        result["ratio"] = result["output_tokens_per_s"] / peer["output_tokens_per_s"]
        print(
            f"peer W1: {peer['output_tokens_per_s']:,.0f} tok/s ({n} prompts, static "
            f"batches of {args.peer_batch_size}); atom/peer = {result['ratio']:.1f}x"
        )

    return peer_run


def run_latency(llm, args: argparse.Namespace, result: dict) -> Callable[[str], None]:
    """W2: one request's steady-state ms per token and the bound. Returns the peer's run of the
    same prompt, for after the engine is shut down."""
    vocab = llm.engine.model_config.vocab_size
    prompt = _clip_vocab(w1_prompts(1, args.input_len, args.input_len, seed=1), vocab)[0]
    spec = llm.engine.speculative
    if spec is not None and args.spec_cost_sweep:
        bench_spec.run_cost_sweep(llm, prompt, args, result)
    measure = decode_ms_per_token if spec is None else bench_spec.ms_per_token
    ms = [measure(llm, prompt, args.output_len) for _ in range(args.iters)]
    bench_spec.report_acceptance(llm, result)
    result.update(
        input_len=args.input_len,
        output_len=args.output_len,
        ms_per_token=min(ms),
        ms_per_token_runs=ms,
    )
    print(f"atom  W2: {min(ms):.3f} ms/token (runs: {', '.join(f'{m:.3f}' for m in ms)})")
    result["bound"] = bench_bound.report(
        llm.engine,
        "latency",
        result["ms_per_token"],
        input_len=args.input_len,
        output_len=args.output_len,
    )
    print(bench_bound.describe("latency", result["bound"]))
    cache = args.peer_cache
    if cache == "auto":
        cache = "dynamic" if llm.engine.model_config.is_hybrid else "static"

    def peer_run(model_path: str) -> None:
        peer = peer_latency(model_path, prompt, args.output_len, cache)
        result["peer"] = peer
        result["ratio"] = peer["ms_per_token"] / result["ms_per_token"]
        print(
            f"peer W2: {peer['ms_per_token']:.3f} ms/token ({peer['system']}); "
            f"peer/atom = {result['ratio']:.2f}x"
        )

    return peer_run


def decode_ms_per_token(llm, prompt: list[int], output_len: int) -> float:
    """Steady-state decode time per token for one request: first token to last, per token."""
    from atom_runtime.protocol.engine_core import EngineRequest
    from atom_runtime.sampling_params import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    rid = f"lat-{time.monotonic_ns()}"
    engine.add_request(EngineRequest(rid, prompt, params))
    stamps = []
    while engine.has_unfinished_requests():
        if engine.step():
            stamps.append(time.perf_counter())
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1000


def llm_model_path(config: EngineConfig):
    from atom_runtime.models.loader import resolve_model_path

    return resolve_model_path(config.model)


def _peer_model(path):
    import torch
    import transformers

    folder = path if path.is_dir() else path.parent
    cfg = transformers.AutoConfig.from_pretrained(folder)
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        try:
            model = transformers.AutoModelForCausalLM.from_config(
                cfg, dtype=dtype, attn_implementation="sdpa"
            )
        except ValueError:  # no SDPA path (GPT-OSS's sinks): its eager attention
            model = transformers.AutoModelForCausalLM.from_config(
                cfg, dtype=dtype, attn_implementation="eager"
            )
    return model.eval()


def peer_throughput(path, prompts, output_len: int, batch_size: int) -> dict:
    """transformers `generate` over static batches (left-padded), greedy, EOS ignored."""
    import torch

    model = _peer_model(path)
    dev = next(model.parameters()).device
    tokens = 0
    _sync()
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch_size):
            chunk = prompts[i : i + batch_size]
            width = max(len(p) for p in chunk)
            ids = torch.zeros((len(chunk), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, p in enumerate(chunk):
                ids[row, width - len(p) :] = torch.tensor(p)
                mask[row, width - len(p) :] = 1
            out = model.generate(
                ids.to(dev),
                attention_mask=mask.to(dev),
                do_sample=False,
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                pad_token_id=0,
            )
            tokens += (out.shape[1] - width) * len(chunk)
    _sync()
    elapsed = time.perf_counter() - start
    return {
        "system": f"transformers generate, static batches, {model.config._attn_implementation}",
        "output_tokens": tokens,
        "seconds": elapsed,
        "output_tokens_per_s": tokens / elapsed,
        "num_prompts": len(prompts),
        "batch_size": batch_size,
    }


def peer_latency(path, prompt: list[int], output_len: int, cache: str = "static") -> dict:
    """transformers single-stream decode: `cache="static"` is its fastest path (a static cache
    with compiled decode), "dynamic" its default cache, eager."""
    import torch

    if cache not in ("static", "dynamic"):
        raise ValueError(f"cache must be 'static' or 'dynamic', got {cache!r}")
    model = _peer_model(path)
    dev = next(model.parameters()).device
    if cache == "static":
        # With a static cache, transformers compiles the decode step itself (its CompileConfig).
        model.generation_config.cache_implementation = "static"
    ids = torch.tensor([prompt], device=dev)

    def timed(n: int) -> float:
        _sync()
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                pad_token_id=0,
            )
        _sync()
        return time.perf_counter() - t

    for _ in range(2):  # compile and warm up
        timed(output_len)
    full = min(timed(output_len) for _ in range(3))
    one = min(timed(1) for _ in range(3))
    system = "static cache, compiled decode" if cache == "static" else "dynamic cache, eager"
    return {
        "system": f"transformers generate, {system}",
        "cache": cache,
        "ms_per_token": (full - one) / (output_len - 1) * 1000,
    }


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _free() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

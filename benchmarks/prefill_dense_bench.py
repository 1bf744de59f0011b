"""Prefill attention of fresh prompts: the engine's dense path against SDPA and the paged kernel.

    python benchmarks/prefill_dense_bench.py [--out prefill_dense.json] [--explore [all]]
    python benchmarks/prefill_dense_bench.py --ttft benchmarks/configs/qwen3-0.6b,...

Kernels: one 8,192-token prompt, one of 5,003 (padded to its 5,120-token bucket on the dense
path), 2 of 4,096, 8 of 1,024 and 5 of mixed lengths, with Llama-3.1-8B (32 q / 8 KV heads,
head_dim 128), Qwen3-0.6B (16 / 8, 128) and Qwen3.5-4B (16 / 4, 256) heads, bf16. q, k and v are
views into one fused qkv tensor, as the layer holds them. Timed: `ops.varlen_causal_attention`
(the dense path), the paged Triton kernel over the same K/V in 16-token pages scattered at
random (its default launch), and torch SDPA on dense contiguous [batch, heads, tokens, head_dim]
tensors (`enable_gqa`; prompts of mixed lengths one call each, times summed), the peer of
earlier sessions' figures. TFLOP/s count 4 * head_dim FLOPs per visible (query, key, head) pair
of the real tokens; `of_sdpa` = SDPA time / this time; `max_err` against the fp32 torch
reference; `engine` is the path the attention layer takes for that step
(`varlen_attention.takes_dense_path`).

`--explore`: each way of the dense path forced for every shape (one flash launch, SDPA per
chunk) and SDPA on dense tensors with flash attention forced, then a CUDA-graph capture of the
dense op replayed with new inputs; `--explore all` adds the public
`torch.nn.attention.varlen.varlen_attn` and cuDNN's ragged attention.

Before the kernels (`first_calls`), per head config: SDPA's first call on an unpadded chunk of a
length it has not seen against its next call (cuDNN builds a plan per shape: what every new
prompt length cost before the buckets), the engine's start-up warm-up of every bucket of an
8,192-token budget (count, seconds), then the dense op's first and next call at lengths never
seen (5,003, 8,001, 1,500, 3,333): after the warm-up a first call should cost what the next does.

`--ttft`: time to first token of one 8,192-token prompt, of one 5,003-token prompt and of 8
prompts of 1,024 (dummy weights, one step each) with the dense path on (the default, where the
start-up probe passes) and off, per model config: the first run of each (the engine's first
sight of 5,003 tokens on the dense path: no plan may be built then) and the best of five.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import time

import torch
from kernels_bench import _paged_cache, _time_ms

HEADS = {"llama-3.1-8b": (32, 8, 128), "qwen3-0.6b": (16, 8, 128), "qwen3.5-4b": (16, 4, 256)}
SHAPES = {"1x8192": [8192], "1x5003": [5003], "2x4096": [4096] * 2, "8x1024": [1024] * 8,
          "5 mixed": [4000, 2500, 1200, 400, 92]}  # fmt: skip
NEW_LENGTHS = (5003, 8001, 1500, 3333)  # first_calls: no bucket, none seen before the timing
BUDGET = 8192  # the engine's default max_num_batched_tokens
# --ttft's steps: one prompt of 8,192 and one of 5,003 tokens, 8 of 1,024 (--ttft-lengths
# replaces them with one prompt of each length given).
TTFT_RUNS = int(os.environ.get("TTFT_RUNS", "5"))  # runs of each setting, alternating
TTFT_SHAPES = {"1x8192": [8192], "1x5003": [5003], "8x1024": [1024] * 8}
PAGE = 16


class FreshPrefill:
    """One step of fresh prompts on the GPU: q, k, v as views into a fused qkv tensor, the
    chunk offsets, the same K/V in a paged cache, and the FLOPs. A lone chunk's qkv tensor is
    the first rows of a buffer padded to its bucket with zeros, as the engine's qkv projection
    leaves it, so `dense` attends in place as a served step does."""

    def __init__(self, heads: tuple[int, int, int], lens: list[int]) -> None:
        from atom_kernels.varlen_attention import bucket_length

        h, kvh, d = heads
        self.heads, self.lens = heads, tuple(lens)
        total = sum(lens)
        self.padded_rows = bucket_length(total) if len(lens) == 1 else 0
        rows = max(total, self.padded_rows)
        qkv = torch.zeros(rows, (h + 2 * kvh) * d, dtype=torch.bfloat16, device="cuda")[:total]
        qkv.normal_()
        self.q = qkv[:, : h * d].view(total, h, d)
        self.k = qkv[:, h * d : (h + kvh) * d].view(total, kvh, d)
        self.v = qkv[:, (h + kvh) * d :].view(total, kvh, d)
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        self.cu = torch.tensor(cu, dtype=torch.int32, device="cuda")
        self.scale = d**-0.5
        self.flops = 4 * d * h * sum(n * (n + 1) // 2 for n in lens)
        self.k_cache, self.v_cache, self.tables = _paged_cache(
            list(lens), kvh, d, PAGE, torch.bfloat16
        )
        for b, (lo, n) in enumerate(zip(cu, lens, strict=False)):
            pos = torch.arange(n, device="cuda")
            blocks = self.tables[b][pos // PAGE].long()
            self.k_cache[blocks, pos % PAGE] = self.k[lo : lo + n]
            self.v_cache[blocks, pos % PAGE] = self.v[lo : lo + n]
        self.seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        self._want: torch.Tensor | None = None

    def want(self) -> torch.Tensor:
        from atom_kernels import reference

        if self._want is None:
            self._want = reference.varlen_causal_attention(
                self.q, self.k, self.v, self.cu, self.lens, self.scale, max(self.lens)
            )
        return self._want

    def dense(self) -> torch.Tensor:
        from atom_kernels import ops

        return ops.varlen_causal_attention(
            self.q, self.k, self.v, self.cu, self.lens, self.scale, max(self.lens),
            self.padded_rows,
        )  # fmt: skip

    def paged(self) -> torch.Tensor:
        from atom_kernels import prefill_attention

        return prefill_attention.paged_attention_prefill(
            self.q, self.k_cache, self.v_cache, self.cu, self.seq_lens, self.tables,
            self.scale, max(self.lens),
        )  # fmt: skip

    def sdpa_ms(self) -> float:
        """SDPA's time on dense tensors: one batched call for prompts of one length, else the
        sum of each prompt's call."""
        if len(set(self.lens)) == 1:
            return _time_ms(self.sdpa_dense()[0])
        total = 0.0
        for n in self.lens:
            total += _time_ms(FreshPrefill(self.heads, [n]).sdpa_dense()[0])
        return total

    def sdpa_dense(self, backend=None):
        """SDPA on contiguous [batch, heads, tokens, head_dim] copies (equal lengths only)."""
        from torch.nn.attention import sdpa_kernel

        n, b = self.lens[0], len(self.lens)
        h, kvh, d = self.heads
        qd = self.q.reshape(b, n, h, d).transpose(1, 2).contiguous()
        kd = self.k.reshape(b, n, kvh, d).transpose(1, 2).contiguous()
        vd = self.v.reshape(b, n, kvh, d).transpose(1, 2).contiguous()
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def run():
            if backend is None:
                o = sdpa(qd, kd, vd, is_causal=True, scale=self.scale, enable_gqa=True)
            else:
                with sdpa_kernel(backend):
                    o = sdpa(qd, kd, vd, is_causal=True, scale=self.scale, enable_gqa=True)
            return o

        return run, lambda o: o.transpose(1, 2).reshape(b * n, h, d)

    def sdpa_per_chunk(self) -> torch.Tensor:
        from atom_kernels import varlen_attention

        outs, lo = [], 0
        for n in self.lens:  # unpadded, one chunk after another (the engine never does this)
            sl = slice(lo, lo + n)
            outs.append(
                varlen_attention.sdpa_causal_rows(self.q[sl], self.k[sl], self.v[sl], self.scale)
            )
            lo += n
        return torch.cat(outs)

    def flash_varlen(self) -> torch.Tensor:
        from atom_kernels import varlen_attention

        return varlen_attention.flash_varlen(
            self.q, self.k, self.v, self.cu, self.scale, max(self.lens)
        )

    def varlen_attn(self) -> torch.Tensor:
        """The public torch.nn.attention.varlen.varlen_attn, whichever signature this torch has."""
        from torch.nn.attention.varlen import varlen_attn

        params = inspect.signature(varlen_attn).parameters
        kw = {"scale": self.scale} if "scale" in params else {}
        if "window_size" in params:
            kw["window_size"] = (-1, 0)
        else:
            kw["is_causal"] = True
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        m = max(self.lens)
        return varlen_attn(self.q, self.k, self.v, self.cu, self.cu, m, m, **kw)

    def cudnn_varlen(self) -> torch.Tensor:
        m = max(self.lens)
        res = torch.ops.aten._cudnn_attention_forward(
            self.q, self.k, self.v, None, self.cu, self.cu, m, m, True, 0.0, True, False,
            scale=self.scale,
        )  # fmt: skip
        return res[0]


def err(got: torch.Tensor, want: torch.Tensor) -> float:
    return round((got.float() - want.float()).abs().max().item(), 4)


def bench_kernels(explore: bool) -> list[dict]:
    from atom_kernels.varlen_attention import takes_dense_path

    rows = []
    for model, heads in HEADS.items():
        for shape, lens in SHAPES.items():
            engine = "dense" if takes_dense_path(tuple(lens), heads[0], heads[2]) else "paged"
            p = FreshPrefill(heads, lens)
            want = p.want()
            sdpa_ms = p.sdpa_ms()
            cands = [("dense (atom)", p.dense, None), ("triton paged", p.paged, None)]
            if explore:
                # Each way of the dense path forced, for any chunk lengths.
                cands += [("flash varlen", p.flash_varlen, None),
                          ("sdpa per chunk", p.sdpa_per_chunk, None)]  # fmt: skip
                if len(set(lens)) == 1:
                    from torch.nn.attention import SDPBackend

                    run, unpack = p.sdpa_dense(SDPBackend.FLASH_ATTENTION)
                    cands.append(("sdpa dense flash", run, unpack))
                if explore == "all":
                    cands += [("varlen_attn", p.varlen_attn, None),
                              ("cudnn varlen", p.cudnn_varlen, None)]  # fmt: skip
            print(f"{model:13s} {shape:7s} {'sdpa dense':16s} {sdpa_ms:7.3f} ms "
                  f"{p.flops / (sdpa_ms * 1e-3) / 1e12:5.0f} TFLOP/s  (engine: {engine})",
                  flush=True)  # fmt: skip
            rows.append(dict(model=model, shape=shape, impl="sdpa dense", ms=round(sdpa_ms, 4),
                             TFLOP_per_s=round(p.flops / (sdpa_ms * 1e-3) / 1e12, 1)))  # fmt: skip
            for name, fn, post in cands:
                try:
                    out = fn()
                    ms = _time_ms(fn)
                except Exception as exc:  # a backend this torch or GPU does not have
                    print(f"{model} {shape} {name}: {type(exc).__name__}: {str(exc)[:160]}")
                    continue
                out = post(out) if post else out
                tflops = p.flops / (ms * 1e-3) / 1e12
                row = dict(model=model, shape=shape, impl=name, ms=round(ms, 4),
                           TFLOP_per_s=round(tflops, 1), of_sdpa=round(sdpa_ms / ms, 3),
                           max_err=err(out, want), engine=engine)  # fmt: skip
                rows.append(row)
                print(f"{model:13s} {shape:7s} {name:16s} {ms:7.3f} ms {tflops:5.0f} TFLOP/s "
                      f"{sdpa_ms / ms:5.0%} of SDPA  err {row['max_err']}", flush=True)  # fmt: skip
            del p, want
            torch.cuda.empty_cache()
    return rows


def check_graph_capture() -> dict:
    """Capture the dense op in a CUDA graph, then replay it on new q/k/v and chunk offsets of the
    same total: equal to eager?"""
    p = FreshPrefill(HEADS["llama-3.1-8b"], [700, 300, 24])
    p.dense()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = p.dense()
    for t in (p.q, p.k, p.v):
        t.copy_(torch.randn_like(t))
    # New chunk lengths no longer than the captured longest (it sizes the launch).
    p.cu.copy_(torch.tensor([0, 600, 1000, 1024], dtype=torch.int32))
    g.replay()
    p.lens, p._want = (600, 400, 24), None
    return {"graph_replay_max_err_vs_reference": err(out, p.want())}


def _first_and_next_ms(fn) -> tuple[float, float]:
    """Wall-clock milliseconds of fn's first call and of its second, each synchronized."""
    times = []
    for _ in range(2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return times[0], times[1]


@torch.inference_mode()
def first_calls() -> list[dict]:
    """Per head config: SDPA's first call on an unpadded chunk of a new length (a plan built)
    against its next, the engine's warm-up of the BUDGET's buckets, then the dense op's first and
    next call at NEW_LENGTHS (each padded to a bucket the warm-up built)."""
    from atom_kernels import varlen_attention

    device = torch.device("cuda")
    p = FreshPrefill(HEADS["qwen3-0.6b"], [42])
    varlen_attention.sdpa_causal_rows(p.q, p.k, p.v, p.scale)  # cuDNN's own start, not a plan
    rows = []
    for model, heads in HEADS.items():
        p = FreshPrefill(heads, [8000])
        first, nxt = _first_and_next_ms(
            lambda p=p: varlen_attention.sdpa_causal_rows(p.q, p.k, p.v, p.scale)
        )
        rows.append(dict(model=model, path="unpadded sdpa", tokens=8000,
                         first_ms=round(first, 2), next_ms=round(nxt, 3)))  # fmt: skip
        print(f"{model:13s} unpadded SDPA, new length 8000: first call {first:.1f} ms, next "
              f"{nxt:.2f} ms", flush=True)  # fmt: skip
        t0 = time.perf_counter()
        warmed = varlen_attention.warm_up(device, torch.bfloat16, *heads, BUDGET)
        warm_s = time.perf_counter() - t0
        rows.append(dict(model=model, path="warm-up", buckets=len(warmed),
                         seconds=round(warm_s, 3)))  # fmt: skip
        print(f"{model:13s} warm-up: {len(warmed)} buckets ({warmed[0]}-{warmed[-1]} tokens) in "
              f"{warm_s:.2f} s", flush=True)  # fmt: skip
        for n in NEW_LENGTHS:
            if n < varlen_attention.min_dense_chunk(heads[0], heads[2]):
                continue  # the engine keeps the paged kernel there
            p = FreshPrefill(heads, [n])
            first, nxt = _first_and_next_ms(p.dense)
            bucket = varlen_attention.bucket_length(n)
            rows.append(dict(model=model, path="dense op after warm-up", tokens=n, bucket=bucket,
                             first_ms=round(first, 2), next_ms=round(nxt, 3)))  # fmt: skip
            print(f"{model:13s} dense op after warm-up, new length {n} (bucket {bucket}): first "
                  f"call {first:.2f} ms, next {nxt:.2f} ms", flush=True)  # fmt: skip
        del p
        torch.cuda.empty_cache()
    return rows


def _host_us(fn, calls: int = 50) -> float:
    """Host microseconds per call of fn, launched back to back without waiting for the GPU
    (fewer launches than the launch queue holds, so the loop never blocks on the device)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return host


@torch.inference_mode()
def host_cost() -> list[dict]:
    """Host (CPU) time per call of each way a lone fresh chunk can attend, per head config at
    4,096 tokens: what the dense path adds to an eager step whose host is its bottleneck (a
    small model's prefill). Ways: the engine's op (padded in place), `sdpa_causal_rows` (SDPA
    inside its backend choice, or cuDNN's op where the probe verified it), SDPA with no backend
    context, cuDNN's aten op called directly, and the paged Triton kernel."""
    from atom_kernels import varlen_attention

    rows = []
    for model, heads in HEADS.items():
        p = FreshPrefill(heads, [4096])
        n = p.lens[0]
        # The start-up probe, which decides whether the engine's op calls cuDNN directly.
        varlen_attention.supported(torch.device("cuda"), torch.bfloat16, *heads)
        direct = (*heads[:2], heads[2], torch.bfloat16) in varlen_attention._CUDNN_DIRECT
        print(f"{model:13s} engine op calls cuDNN directly: {direct}", flush=True)
        qt, kt, vt = (t.transpose(0, 1)[None] for t in (p.q, p.k, p.v))

        def plain_sdpa(qt=qt, kt=kt, vt=vt, scale=p.scale):
            return torch.nn.functional.scaled_dot_product_attention(
                qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True
            )

        def cudnn_direct(qt=qt, kt=kt, vt=vt, scale=p.scale):
            return torch.ops.aten._scaled_dot_product_cudnn_attention(
                qt, kt, vt, None, False, 0.0, True, False, scale=scale
            )[0]

        ways = {
            "engine op": p.dense,
            "sdpa_causal_rows": lambda p=p: varlen_attention.sdpa_causal_rows(
                p.q, p.k, p.v, p.scale
            ),
            "sdpa, no backend context": plain_sdpa,
            "cudnn op direct": cudnn_direct,
            "paged kernel": p.paged,
        }
        for way, fn in ways.items():
            try:
                fn()
                us = _host_us(fn)
                gpu_ms = _time_ms(fn)
            except Exception as exc:
                print(f"{model:13s} {way}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                continue
            rows.append(dict(model=model, way=way, tokens=n, host_us=round(us, 1),
                             gpu_ms=round(gpu_ms, 4)))  # fmt: skip
            print(f"{model:13s} {way:26s} host {us:6.1f} us a call, GPU {gpu_ms:.3f} ms",
                  flush=True)  # fmt: skip
    return rows


def fresh_prompt_engine(path: str):
    """The engine the TTFT figures come from (dense path opted in, the start-up probe deciding;
    dummy weights, prefix caching off, eager, a BUDGET-token step): (llm, its attention layers,
    whether the dense path is on, a function of (length, seed) giving a prompt)."""
    from atom_runtime import LLM

    os.environ["ATOM_DENSE_PREFILL"] = "1"
    llm = LLM(path, load_format="dummy", max_model_len=8320, max_num_batched_tokens=BUDGET,
              enable_prefix_caching=False, enforce_eager=True)  # fmt: skip
    layers = llm.engine.executor.model.attention_layers()
    vocab = llm.engine.model_config.vocab_size

    def prompt(n: int, seed: int = 0) -> list[int]:
        return [(7919 * j + 31 * seed) % (vocab - 200) + 100 for j in range(n)]

    return llm, layers, layers[0].dense_prefill, prompt


def ttft(models: list[str]) -> list[dict]:
    """Time to first token of one 8,192-token prompt, one of 5,003 and 8 prompts of 1,024 (each
    one step), dense path on and off (same engine: the layers' flag flipped), TTFT_RUNS runs each,
    alternating (dense on first), prefix caching off, eager. Reports each setting's first run
    (dense on at 5,003 tokens: the engine's first sight of that length, which must find the plan
    start-up built for its bucket), its best and its median."""
    from atom_runtime import SamplingParams
    from atom_runtime.protocol.engine_core import EngineRequest

    rows = []
    for path in models:
        llm, layers, supported, make_prompt = fresh_prompt_engine(path)
        engine = llm.engine
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        for shape, lens in TTFT_SHAPES.items():
            prompts = [make_prompt(n, i) for i, n in enumerate(lens)]
            for dense in ([True, False] * TTFT_RUNS) if supported else [False] * TTFT_RUNS:
                for layer in layers:
                    layer.dense_prefill = dense
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for prompt in prompts:
                    engine.add_request(EngineRequest(f"t{time.monotonic_ns()}", prompt, params))
                while engine.has_unfinished_requests():
                    engine.step()
                torch.cuda.synchronize()
                ms = (time.perf_counter() - t0) * 1e3
                rows.append(dict(model=path, shape=shape, dense=dense, ttft_ms=round(ms, 2)))
            for dense in (True, False):
                got = [r["ttft_ms"] for r in rows
                       if r["model"] == path and r["shape"] == shape and r["dense"] == dense]  # fmt: skip
                if got:
                    print(f"{path} TTFT {shape}, dense {'on ' if dense else 'off'}: first run "
                          f"{got[0]:.1f} ms, best {min(got):.1f} ms, median "
                          f"{statistics.median(got):.1f} (runs {got})", flush=True)  # fmt: skip
        for layer in layers:
            layer.dense_prefill = supported
        llm.shutdown()
        del llm, engine, layers
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--explore", nargs="?", const="ways", choices=["ways", "all"])
    ap.add_argument("--ttft", default="", help="comma-separated model configs (TTFT only)")
    ap.add_argument("--ttft-lengths", default="", help="comma-separated one-prompt lengths")
    ap.add_argument("--host-cost", action="store_true", help="host time per call of each way")
    args = ap.parse_args()
    if args.ttft_lengths:
        TTFT_SHAPES.clear()
        TTFT_SHAPES.update({f"1x{n}": [int(n)] for n in args.ttft_lengths.split(",")})
    from torch.nn.attention import varlen

    env = dict(torch=torch.__version__, device=torch.cuda.get_device_name(),
               varlen_attn=str(inspect.signature(varlen.varlen_attn)))  # fmt: skip
    print(env, flush=True)
    result = {"env": env}
    if args.host_cost:
        result["host_cost"] = host_cost()
    elif args.ttft:
        result["ttft"] = ttft(args.ttft.split(","))
    else:
        result["first_calls"] = first_calls()
        result["kernels"] = bench_kernels(args.explore)
    if args.explore:
        try:
            result["graph"] = check_graph_capture()
        except Exception as exc:
            result["graph"] = {"error": f"{type(exc).__name__}: {exc}"}
        print(result["graph"], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())

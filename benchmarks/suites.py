"""The benchmark suites: what `benchmarks/run.py` runs, suite by suite.

Each suite is a short list of commands, written as a user would type them from the repository
root (`atom` is `python -m atom_runtime`). Placeholders: `$Q3`, `$L8`, `$H4`, `$M35`, `$Q30`,
`$G20` (and the block-FP8 `$L8B`, `$Q3B`) are the model configs in benchmarks/configs/ (dummy
weights: a bare config.json), `$json` the folder each command writes its JSON result into (folded into `results.json` by the runner), `$port` a free
TCP port. docs/benchmarks.md says which published figure each command gives.

A suite with `pending` uses flags that another issue is building; the runner refuses to start it
(naming the unknown flag) until this checkout's `atom` knows them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MODELS = {
    "Q3": "benchmarks/configs/qwen3-0.6b",
    "L8": "benchmarks/configs/llama-3.1-8b",
    "H4": "benchmarks/configs/qwen3.5-4b",
    "M35": "benchmarks/configs/qwen3.5-35b-a3b",
    "Q30": "benchmarks/configs/qwen3-30b-a3b",
    "G20": "benchmarks/configs/gpt-oss-20b",
    "D4M": "benchmarks/configs/deepseek-v3-4l-mtp",
    # The same architectures with a block-FP8 quantization_config (128 x 128, DeepSeek-V3's and
    # Qwen3-*-FP8's layout): dummy weights quantized at load in that layout.
    "L8B": "benchmarks/configs/llama-3.1-8b-fp8-block",
    "Q3B": "benchmarks/configs/qwen3-0.6b-fp8-block",
}


@dataclass(frozen=True)
class Step:
    """One command. `clients` makes it a server: it is started in the background, the clients
    run one after another against it, and it is stopped when the last one ends."""

    command: str
    timeout_s: int = 900
    env: dict[str, str] = field(default_factory=dict)
    clients: tuple[Step, ...] = ()


@dataclass(frozen=True)
class Suite:
    name: str
    about: str
    steps: tuple[Step, ...]
    pending: str = ""  # the issue whose flags the suite needs, while they are being built


def _w2(model: str, name: str, extra: str = "") -> Step:
    return Step(
        f"atom bench latency --load-format dummy --model ${model}{extra} "
        f"--output-json $json/{name}.json",
        timeout_s=600,
    )


def _w1(model: str, name: str, extra: str = "", timeout_s: int = 600) -> Step:
    return Step(
        f"atom bench throughput --load-format dummy --model ${model}{extra} "
        f"--output-json $json/{name}.json",
        timeout_s=timeout_s,
    )


# Hybrids with their recurrent state in bf16 (issue 40).
_BF16_STATE = " --mamba-ssm-cache-dtype bfloat16"


def _spec(config: str) -> str:
    """W7's flags: the drafter, and the step-cost sweep."""
    return f" --speculative-config '{config}' --spec-cost-sweep"


def _serve_client(rate: str) -> Step:
    return Step(
        "atom bench serve --port $port --model $Q3 --dataset-name sharegpt --num-prompts 512 "
        f"--request-rate {rate} --ignore-eos --disable-tqdm "
        f"--result-filename $json/w4_sharegpt_{rate}.json",
        timeout_s=900,
    )


SUITES: tuple[Suite, ...] = (
    Suite(
        "tests",
        "every kernel test compiled for the GPU (bf16 and fp16 where a test has them)",
        (Step("pytest -q -p no:cacheprovider tests/kernels", timeout_s=2400),),
    ),
    Suite(
        "gputests",
        "every test marked gpu: engine parity with transformers, CUDA graphs, PDL, hybrids, "
        "state checkpoints, KV transfer (bf16 agreement lands in results.json)",
        (Step("pytest -q -p no:cacheprovider -m gpu tests", timeout_s=2400),),
    ),
    Suite(
        "w1",
        "W1 offline throughput: Qwen3-0.6B and the Qwen3.5-4B dense hybrid, bound printed",
        (_w1("Q3", "w1_qwen3-0.6b"), _w1("H4", "w1_qwen3.5-4b")),
    ),
    Suite(
        "w2",
        "W2 batch-1 decode latency: Qwen3-0.6B, Llama-3.1-8B, Qwen3.5-4B, bound printed; then "
        "where a batch-1 decode step's GPU time goes, kernel by kernel (torch.profiler), for "
        "each model config",
        (
            _w2("Q3", "w2_qwen3-0.6b"),
            _w2("L8", "w2_llama-3.1-8b"),
            _w2("H4", "w2_qwen3.5-4b"),
            *(
                Step(
                    f"python benchmarks/trace_decode.py --model ${key} "
                    f"--out $json/trace_{path.rsplit('/', 1)[-1]}.json"
                )
                for key, path in MODELS.items()
            ),
        ),
    ),
    Suite(
        "w3",
        "W3 prefix reuse: TTFT over a cached 8,000-token prefix against caching off, and the "
        "scheduler's admission alone",
        (
            Step("atom bench prefix --load-format dummy --model $Q3 --output-json $json/w3.json"),
            Step(
                "atom bench prefix --load-format dummy --model $Q3 --output-len 1 "
                "--at-once-requests 61 --output-json $json/w3_max1.json"
            ),
            Step("atom bench prefix --admission-only --output-json $json/w3_admission.json"),
        ),
    ),
    Suite(
        "w4",
        "W4 online serving: ShareGPT-shaped Poisson load at 16, 64 and unbounded requests/s "
        "against `atom serve`; then W1 through HTTP against W1 offline, same call (0.6B, 4B)",
        (
            Step(
                "atom serve --load-format dummy --model $Q3 --port $port",
                clients=(
                    _serve_client("16"),
                    _serve_client("64"),
                    _serve_client("inf"),
                ),
            ),
            Step(
                "python benchmarks/serve_cpu_cost.py --model $Q3 --offline --client-procs 4 "
                "--output-json $json/w4_http_qwen3-0.6b.json"
            ),
            Step(
                "python benchmarks/serve_cpu_cost.py --model $H4 --offline --client-procs 4 "
                "--output-json $json/w4_http_qwen3.5-4b.json"
            ),
        ),
    ),
    Suite(
        "w5",
        "W5 multi-turn reuse on the dense hybrid: the default checkpoints against prefix "
        "caching off, then the other checkpoint intervals",
        (
            Step(
                "atom bench multiturn --load-format dummy --model $H4 "
                "--state-checkpoint-interval-tokens=-1 --output-json $json/w5.json",
                timeout_s=600,
            ),
            Step(
                "atom bench multiturn --load-format dummy --model $H4 --no-baseline "
                "--state-checkpoint-interval-tokens=512,2048,8192 "
                "--output-json $json/w5_intervals.json",
                timeout_s=900,
            ),
        ),
    ),
    Suite(
        "kernels",
        "attention kernels (decode TB/s, prefill TFLOP/s against SDPA, W3's step, W1's decode by "
        "KV heads a program), batch-1 GEMV launch shapes against cuBLAS, the dense prefill path, "
        "its crossover and its TTFT",
        (
            Step("python benchmarks/kernels_bench.py --out $json/kernels.json"),
            Step(
                "python benchmarks/kernels_bench.py --sweep w1pack --sweep-only "
                "--out $json/decode_w1pack.json"
            ),
            Step("python benchmarks/gemv_sweep.py --model $L8 --out $json/gemv_llama-3.1-8b.json"),
            Step("python benchmarks/gemv_sweep.py --model $Q3 --out $json/gemv_qwen3-0.6b.json"),
            Step("python benchmarks/prefill_dense_bench.py --out $json/prefill_dense.json"),
            Step("python benchmarks/dense_crossover.py --out $json/dense_crossover.json"),
            Step(
                "python benchmarks/prefill_dense_bench.py --ttft $L8,$Q3 "
                "--out $json/prefill_dense_ttft.json"
            ),
        ),
    ),
    # Issue 40's before/after comes first (about 10 minutes): a run cut by a time limit keeps
    # every command that finished.
    Suite(
        "hybrid",
        "the hybrids at full batch first: the wide GDN decode kernel's tests compiled, then per "
        "GDN decode path (ATOM_GDN_DECODE=split: before; default: after; after with a bf16 "
        "recurrent state) one engine that runs W1 (bound printed) and traces a W1 decode step "
        "by kernel group, for the 4B, W2 of the 4B, the same W1 + trace for the 35B-A3B; then "
        "hybrid kernels (fused GDN decode at batch 1-16 and both decode kernels' launch shapes "
        "at 64 and 256, GDN prefill chunks, MoE pair GEMV), the 35B-A3B's W2, the 4B's W1 with "
        "state checkpoints off and on, the 35B-A3B's W1 with a bf16 recurrent state",
        (
            Step(
                "pytest -q -p no:cacheprovider tests/kernels/test_gdn_decode_wide.py "
                "tests/kernels/test_hybrid_kernels_gpu.py -k 'wide or fused_decode'",
                timeout_s=900,
            ),
            Step(
                "python benchmarks/trace_w1_step.py --model $H4 --w1 "
                "--variants split,auto,auto:bfloat16 --out $json/w1_trace_qwen3.5-4b.json",
                timeout_s=1200,
            ),
            _w2("H4", "w2_qwen3.5-4b"),
            Step(
                "python benchmarks/trace_w1_step.py --model $M35 --w1 --variants split,auto "
                "--out $json/w1_trace_qwen3.5-35b-a3b.json",
                timeout_s=1500,
            ),
            Step(
                "python benchmarks/gdn_decode_bench.py --batch 1,4,16 --sweep "
                "--out $json/gdn_decode.json"
            ),
            Step(
                "python benchmarks/gdn_decode_bench.py --batch 64,256 --sweep --parts gdn "
                "--state-dtype float32,bfloat16 --out $json/gdn_decode_full_batch.json"
            ),
            Step("python benchmarks/gdn_prefill_bench.py --out $json/gdn_prefill.json"),
            Step("python benchmarks/moe_gemv_sweep.py --tokens 1,2,4,8 --out $json/moe_gemv.json"),
            _w2("M35", "w2_qwen3.5-35b-a3b"),
            _w1("H4", "w1_qwen3.5-4b_ckpt_off", " --state-checkpoint-interval-tokens 0"),
            _w1("H4", "w1_qwen3.5-4b_ckpt_on", " --state-checkpoint-interval-tokens -1"),
            _w1("M35", "w1_qwen3.5-35b-a3b_bf16state", _BF16_STATE),
        ),
    ),
    Suite(
        "moe",
        "issue 36's models: W2 and W1 of Qwen3-30B-A3B (Qwen3-MoE) and GPT-OSS-20B (sliding "
        "window + sinks, bf16 experts: dummy weights have no MXFP4), each with the transformers "
        "peer in the same call and the bound printed",
        (
            _w2("Q30", "w2_qwen3-30b-a3b", " --peer transformers"),
            _w2("G20", "w2_gpt-oss-20b", " --peer transformers"),
            _w1(
                "Q30",
                "w1_qwen3-30b-a3b",
                " --peer transformers --peer-num-prompts 16 --peer-batch-size 16",
                timeout_s=900,
            ),
            _w1(
                "G20",
                "w1_gpt-oss-20b",
                " --peer transformers --peer-num-prompts 16 --peer-batch-size 16",
                timeout_s=900,
            ),
        ),
    ),
    Suite(
        "pd",
        "prefill/decode disaggregation on one GPU: TCP and NIXL connector GB/s, TTFT/TPOT "
        "aggregated against disaggregated over each connector, KV-aware against round-robin "
        "routing (NIXL steps need nixl-cu12/-cu13 installed, docs/disaggregation.md)",
        (
            Step("python benchmarks/pd_bench.py transfer --check --out $json/pd_transfer.json"),
            Step(
                "python benchmarks/pd_bench.py transfer --connector nixl --check "
                "--out $json/pd_transfer_nixl.json"
            ),
            Step(
                "python benchmarks/pd_bench.py serve --model $Q3 --rates 4,16,32,64 "
                "--modes aggregated,disaggregated,disaggregated-nixl "
                "--num-requests 64 --input-len 2048 --output-len 128 --out $json/pd_serve.json",
                timeout_s=1800,
            ),
            # The hybrid Qwen3.5-4B through P/D: its state checkpoint travels with the KV.
            Step(
                "python benchmarks/pd_bench.py serve --model $H4 --rates 4 "
                "--modes aggregated,disaggregated-nixl --num-requests 32 --input-len 2048 "
                "--output-len 128 --out $json/pd_serve_hybrid.json",
                timeout_s=1200,
            ),
            # Hit rate is what routing changes: the start-up's one-row kernel timing is skipped.
            Step(
                "python benchmarks/pd_bench.py routing --model $Q3 --groups 16 --prefix-len 2048 "
                "--num-requests 256 --concurrency 16 --kv-blocks 1600 "
                "--out $json/pd_routing.json",
                env={"ATOM_SMALL_M_KERNELS": "cublas"},
            ),
        ),
    ),
    Suite(
        "peers",
        "the transformers peer in the same call as ATOM: W1 and W2 of every model config "
        "(slow: the peer runs eager or compiles)",
        (
            _w1("Q3", "w1_qwen3-0.6b_peer", " --peer transformers --peer-num-prompts 64"),
            _w2("Q3", "w2_qwen3-0.6b_peer", " --peer transformers"),
            _w2("L8", "w2_llama-3.1-8b_peer", " --peer transformers"),
            _w2("H4", "w2_qwen3.5-4b_peer", " --peer transformers"),
            _w1(
                "H4",
                "w1_qwen3.5-4b_peer",
                " --peer transformers --peer-num-prompts 16 --peer-batch-size 16",
                timeout_s=900,
            ),
            _w1(
                "M35",
                "w1_qwen3.5-35b-a3b_peer",
                " --peer transformers --peer-num-prompts 16 --peer-batch-size 16",
                timeout_s=900,
            ),
        ),
    ),
    # Issue 39's start-up figures. Each `atom bench startup` writes a random-bf16 checkpoint of
    # the config to local disk, starts `atom serve` once with an empty compile cache (the first
    # start), then per load format: the page cache dropped, the weights loaded in-process (read
    # GB/s, load seconds) and a served start to /health 200 with its atom:startup_seconds phases
    # (the compile cache warm: the second start). The dummy-weights run of $Q3 is the issue's own
    # baseline (14.5 s warm, 39 s fresh on an H200); the 8B run is its target, <= 20 s warm.
    Suite(
        "startup",
        "cold start (issue 39): first against second start (compile cache), and per load format "
        "read GB/s, load seconds and time to healthy, for Qwen3-0.6B and a real-sized 8B",
        (
            Step(
                "atom bench startup --model $Q3 --dir /tmp/atom-startup/qwen3-0.6b "
                "--load-formats dummy,safetensors,auto --port $port "
                "--output-json $json/startup_qwen3-0.6b.json",
                timeout_s=900,
            ),
            Step(
                "atom bench startup --model $L8 --dir /tmp/atom-startup/llama-3.1-8b "
                "--load-formats safetensors,auto,fastsafetensors,runai_streamer --port $port "
                "--output-json $json/startup_llama-3.1-8b.json",
                timeout_s=1800,
            ),
        ),
    ),
    # W6 (docs/benchmarks.md): each FP8 figure beside its bf16 twin, in one call. W2 in
    # per-channel FP8 (`--quantization fp8`) and block FP8 (a block-FP8 config's dummy weights);
    # W1 with an FP8 KV cache; every command prints the resident weight bytes.
    Suite(
        "fp8",
        "W6: W2 with FP8 weights (per-channel and 128x128 blocks) and W1 with an FP8 KV cache, "
        "each beside its bf16 twin; resident weight bytes",
        (
            _w2("L8", "w6_w2_llama-3.1-8b_bf16"),
            _w2("L8", "w6_w2_llama-3.1-8b_fp8", " --quantization fp8"),
            _w2("L8B", "w6_w2_llama-3.1-8b_fp8block"),
            _w2("Q3", "w6_w2_qwen3-0.6b_bf16"),
            _w2("Q3", "w6_w2_qwen3-0.6b_fp8", " --quantization fp8"),
            _w2("Q3B", "w6_w2_qwen3-0.6b_fp8block"),
            _w1("Q3", "w6_w1_qwen3-0.6b_bf16kv"),
            _w1("Q3", "w6_w1_qwen3-0.6b_fp8kv", " --kv-cache-dtype fp8"),
            _w1("L8", "w6_w1_llama-3.1-8b_bf16"),
            _w1("L8", "w6_w1_llama-3.1-8b_fp8", " --quantization fp8 --kv-cache-dtype fp8"),
            Step(
                "pytest -q -p no:cacheprovider -m gpu tests/runtime/models/test_fp8_gpu.py",
                timeout_s=1200,
            ),
        ),
    ),
    # W7: with dummy weights acceptance means nothing, so these time the steps (a plain decode
    # step, a verify step of k = 1..5 drafts, a drafter proposal) and print the per-token
    # latency at acceptance 0.6 / 0.8 / 0.9 (`--spec-cost-sweep`); the real acceptance comes
    # from the CPU run in docs/benchmarks.md.
    Suite(
        "spec",
        "W7: speculative step costs (n-gram, a 1B-class draft, the MTP heads of the hybrid and "
        "of DeepSeek-V3) and the "
        "per-token latency they give at acceptance 0.6/0.8/0.9, beside the 8B's plain W2 (the "
        "goal: ms_per_token_a0.8 at k = 4 <= 0.45x it)",
        (
            _w2("L8", "w7_llama-3.1-8b_plain"),
            _w2(
                "Q3", "w7_qwen3-0.6b_ngram", _spec('{"method":"ngram","num_speculative_tokens":5}')
            ),
            _w2(
                "L8",
                "w7_llama-3.1-8b_ngram",
                _spec('{"method":"ngram","num_speculative_tokens":5}'),
            ),
            _w2(
                "L8",
                "w7_llama-3.1-8b_draft1b",
                _spec(
                    '{"method":"draft_model","model":"benchmarks/configs/llama-3.2-1b",'
                    '"num_speculative_tokens":5}'
                ),
            ),
            _w2("H4", "w7_qwen3.5-4b_mtp", _spec('{"method":"mtp","num_speculative_tokens":5}')),
            _w2(
                "D4M",
                "w7_deepseek-v3-4l_mtp",
                _spec('{"method":"deepseek_mtp","num_speculative_tokens":3}'),
            ),
        ),
    ),
)

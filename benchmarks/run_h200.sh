#!/usr/bin/env bash
# The GPU check-and-measure cycle on one H200, in one go: kernel tests compiled for real (bf16,
# fp16), engine parity on the GPU, W2 and W1 for ATOM, kernel microbenchmarks, a step profile,
# then the transformers peer in the same run.
# Usage (repository root, on the GPU machine): OUT=results bash benchmarks/run_h200.sh [stage...]
# Stages: tests enginetests bench kernels profile trace sweep asynccheck peer peerw2 peer8b final
#   w3 (prefix reuse, `atom bench prefix`) w4 (online serving: `atom serve` + `atom bench serve`)
#   gemv (the GEMV's compiled tests and its paths in the engine, then W2 on the 8B with its
#   one-row path choices)
#   pd (issue 16: TCP connector GB/s, aggregated vs disaggregated serving, KV-aware vs
#   round-robin routing) w5 (issue 15: `atom bench multiturn` on the dense hybrid, every interval)
#   hybrid (the fused GDN decode kernels compiled, their microbenchmark, W2 on the dense hybrid)
#   mixed (step cost by kind with prefill chunks joining decodes, dense hybrid, W5's shape)
#   kvx (the KV connector's tests with its GPU path, transfer GB/s) pdserve (disaggregated serving
#   at two rates) hybridparity (fp32 greedy parity of the dense hybrid on the GPU)
#   tracehybrid (per-kernel trace of a batch-1 decode step of the dense hybrid)
#   ckpt (issue 15's GPU tests) w4http (W1 through HTTP vs offline, server CPU per token)
#   hybridpeer (W2 of the dense hybrid with its transformers peer)
#   pdl (W2 with programmatic dependent launch off and on, same call)
#   w3graphs (short prefill steps through CUDA graphs: GPU tests, W3 with and without them)
#   qknorm (the fused QK-norm qkv GEMV: tests, W2, trace)
#   qksweep (the fused QK-norm qkv path's shapes, start-up timings, prefill by page size)
#   w2paths (decode merge, W2 auto vs forced fused GEMVs)
#   w2q3 (W2 on Qwen3-0.6B alone) w2checked (one-row paths with and without the step check)
#   b1attn (decode attention at batch 1, split counts and tiles) gputests (every GPU engine test)
#   gdnsplit (the fused GDN decode with Dv split: tests, sweep, W2 and trace of the dense hybrid)
#   gemvh4 (the GEMV's launch shapes on the dense hybrid's projections)
#   w2all (W2 on the 0.6B, 8B and dense hybrid, with the start-up's one-row choices logged)
#   early (W2 on the three models with the GEMV's early columns at 1, 4 and 8 steps)
#   w2early (W2 on the three models with the default early columns, 2,048 on two, GPU tests)
#   skipnorm (W2 with the one-row norms skipped: what removing their launches could buy)
#   denseprofile (a fresh prompt's prefill step traced, dense path on and off)
#   densehost (host time per call of each way a lone fresh chunk can attend)
#   w3dense (W3 with the dense prefill forced on for the 0.6B, and off)
#   w1heads (W1's decode attention by grid order and launch settings; W1 with each grid order)
#   moegemv (the MoE pair GEMV's GPU test; W2 of the 35B-A3B MoE hybrid with it off and on; a
#   trace of its batch-1 step with it on)  w1hybrid (W1 of both hybrids with the peer and bound)
#   moe2 (the router kernel and the stacked shared expert: GPU tests, W2 and W1 of the 35B MoE)
#   moe3 (the pair GEMV's launch shapes timed at start-up: GPU tests, the table, both MoE paths
#   at MOE_TOKENS step sizes, W2, a trace)  hybridgpu (hybrid GPU tests from a cold cache)
#   w1ckpt (the dense hybrid's W1 with state checkpoints off and on)
#   w1bal (W1's decode attention by program order, grid order, split count and cache layout)
#   w1order (W1 with the decode grid's KV heads fastest off and on)
#   w1launch (W1's decode attention by launch settings)
#   w1pack (two KV heads a decode program: GPU tests, the kernel by heads a program, W1 and W2
#   off and on)
#   crossover (dense prefill vs the paged kernel by prompt length)
#   w2shapes (W2 with the start-up's GEMV launch-shape timings) densecheck (the dense prefill as shipped)
#   pnlog (the start-up's one-row timings per path with it offered)
#   producernorm2 (the same: start-up timings per path, and every group forced onto its GEMV)
#   producernorm (W2 with the norm's add and sums of squares in the GEMV before it, on and off)
#   freshprefill (fresh prompts' dense prefill path: its GPU tests, kernels against SDPA and the paged
#   kernel, TTFT of an 8k prompt with it on and off)
# What the next session with device time should run first:
#   w1pack (the decode GPU tests with two KV heads a program, W1 off/on: confirms the gain on a
#   third machine)  |  w1ckpt (the hybrid's W1 with checkpoints off/on after the known-end change)
#   (gputests4 passed on this session's final code: 40 of 40)
# (default: tests bench kernels peer).
# Python packages the image lacks travel as wheels in .whl/ (`.whl/` in .git/info/exclude, the
# device call carries it). On 2026-12-02 these were needed (cp312 manylinux wheels, --no-deps):
# msgspec pyzmq fastapi starlette pydantic pydantic_core annotated-types typing-inspection
# opentelemetry-api fastapi_offline uvicorn httptools setproctitle gguf transformers>=5.24
# fla-core; the versions of this machine's .venv (`pip list`) are the ones to fetch.
set -uo pipefail
OUT=${OUT:-results}
mkdir -p "$OUT/json"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=$PWD/runtime:$PWD/kernels:$PWD/operator:$PWD:/tmp/site
export PYTHONUNBUFFERED=1 ATOM_REPORT_DIR=$OUT/json
Q3=benchmarks/configs/qwen3-0.6b
L8=benchmarks/configs/llama-3.1-8b
H4=benchmarks/configs/qwen3.5-4b
merge_results() {
  # At most 8 files come back from the device tool: fold every JSON result into one file.
  python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
merged = {p.stem: json.loads(p.read_text()) for p in sorted((out / "json").glob("*.json"))}
(out / "results.json").write_text(json.dumps(merged, indent=2))
for p in (out / "json").glob("*.json"):
    p.unlink()
(out / "json").rmdir()
PY
}
trap merge_results EXIT
# `timeout` cannot run this function: under a timeout, call `python3 -m atom_runtime` itself.
atom() { python3 -m atom_runtime "$@" 2>&1 | grep -v -i warning; }
for stage in ${*:-tests bench kernels peer}; do
  echo "== $stage"
  case $stage in
    tests)
      nvidia-smi -L
      python3 -m pytest -q -p no:cacheprovider tests/kernels tests/runtime/test_gpu_engine.py 2>&1 | tail -15 ;;
    final)
      python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fused.py 2>&1 | tail -3
      atom bench latency --load-format dummy --model $Q3 --output-json "$OUT/json/w2_qwen3_0.6b.json"
      python3 -m pytest -q -p no:cacheprovider -x tests/runtime/test_gpu_engine.py -k "graph_replay or (parity and (qwen3 or llama3))" 2>&1 | tail -3
      atom bench latency --load-format dummy --model $L8 --iters 2 --output-json "$OUT/json/w2_llama_8b.json"
      atom bench throughput --load-format dummy --model $Q3 --output-json "$OUT/json/w1_qwen3_0.6b.json" ;;
    freshprefill)
      # Issue 18 item 4: fresh prompts' dense prefill path against SDPA and the paged kernel,
      # its GPU tests, and TTFT of one 8k prompt and of 8 x 1k with it on and off.
      python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_kernels_gpu.py -k dense 2>&1 | tail -2
      timeout 120 python3 benchmarks/prefill_dense_bench.py --explore --out "$OUT/json/prefill_dense.json" 2>&1 | grep -v -i "warn\|o = sdpa"
      timeout 90 python3 -m pytest -q -p no:cacheprovider tests/runtime/test_gpu_engine.py -k "fresh_prompts or cached_prefix_keeps or prefill_graphs" 2>&1 | tail -2
      timeout 90 python3 benchmarks/prefill_dense_bench.py --ttft $L8,$Q3 --out "$OUT/json/prefill_dense_ttft.json" 2>&1 | grep "TTFT\|Error" ;;
    gemv)
      python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gemv.py tests/kernels/test_tickets.py tests/kernels/test_triton_kernels_gpu.py 2>&1 | tail -3
      python3 -m pytest -q -p no:cacheprovider tests/runtime/test_gpu_engine.py -k one_row_paths 2>&1 | tail -3
      atom bench latency --load-format dummy --model $L8 --output-json "$OUT/json/w2_llama_8b.json" ;;
    enginetests)
      python3 -m pytest -q -p no:cacheprovider tests/runtime/test_gpu_engine.py 2>&1 | tail -15 ;;
    bench)
      atom bench latency --load-format dummy --model $Q3 --output-json "$OUT/json/w2_qwen3_0.6b.json"
      atom bench latency --load-format dummy --model $L8 --output-json "$OUT/json/w2_llama_8b.json"
      atom bench throughput --load-format dummy --model $Q3 --output-json "$OUT/json/w1_qwen3_0.6b.json" ;;
    kernels)
      python3 benchmarks/kernels_bench.py --out "$OUT/json/kernels.json" 2>&1 | tail -12 ;;
    trace)
      python3 benchmarks/trace_decode.py --model $Q3 --out "$OUT/json/trace_q3.json" 2>&1 | grep -v -i warn | head -24
      python3 benchmarks/trace_decode.py --model $L8 --out "$OUT/json/trace_l8.json" 2>&1 | grep -v -i warn | head -24 ;;
    sweep)
      python3 benchmarks/gemv_sweep.py --model $L8 --out "$OUT/json/gemv_sweep_l8.json" 2>&1 | grep -v -i warn
      python3 benchmarks/gemv_sweep.py --model $Q3 --out "$OUT/json/gemv_sweep_q3.json" 2>&1 | grep -v -i warn ;;
    asynccheck)
      python3 benchmarks/debug_async.py --model $Q3 --mode off --out "$OUT/async_off.txt"
      python3 benchmarks/debug_async.py --model $Q3 --mode on --out "$OUT/async_on.txt"
      cmp "$OUT/async_off.txt" "$OUT/async_on.txt" && echo "async scheduling: same tokens" ;;
    profile)
      python3 benchmarks/profile_step.py --model $Q3 --batch 1 2>&1 | tail -25 | cut -c1-150 | tee "$OUT/profile_b1.txt"
      python3 benchmarks/profile_step.py --model $Q3 --batch 256 2>&1 | tail -25 | cut -c1-150 | tee "$OUT/profile_b256.txt" ;;
    peer)
      atom bench latency --load-format dummy --model $Q3 --peer transformers --output-json "$OUT/json/w2_qwen3_0.6b_peer.json"
      atom bench throughput --load-format dummy --model $Q3 --peer transformers --peer-num-prompts 64 --output-json "$OUT/json/w1_qwen3_0.6b_peer.json" ;;
    peerw2)
      atom bench latency --load-format dummy --model $Q3 --peer transformers --iters 1 --output-json "$OUT/json/w2_qwen3_0.6b_peer.json" ;;
    peer8b)
      atom bench latency --load-format dummy --model $L8 --peer transformers --output-json "$OUT/json/w2_llama_8b_peer.json" ;;
    w3)
      atom bench prefix --load-format dummy --model $Q3 --output-json "$OUT/json/w3_qwen3_0.6b.json"
      atom bench prefix --load-format dummy --model $Q3 --output-len 1 --at-once-requests 61 --output-json "$OUT/json/w3_qwen3_0.6b_max1.json"
      atom bench prefix --admission-only --output-json "$OUT/json/w3_admission.json" ;;
    pd)
      python3 benchmarks/pd_bench.py transfer --out "$OUT/json/pd_transfer.json" 2>&1 | grep -v -i warn
      python3 benchmarks/pd_bench.py serve --model $Q3 --rates 4,16,32,64 --num-requests 64 \
        --input-len 2048 --output-len 128 --out "$OUT/json/pd_serve.json" 2>&1 | grep -v -i warn
      # Hit rate is what routing changes; the one-row kernel timing at start-up is skipped.
      ATOM_SMALL_M_KERNELS=cublas python3 benchmarks/pd_bench.py routing --model $Q3 --groups 16 \
        --prefix-len 2048 --num-requests 256 --concurrency 16 --kv-blocks 1600 \
        --out "$OUT/json/pd_routing.json" 2>&1 | grep -v -i warn ;;
    w5)
      atom bench multiturn --load-format dummy --model $H4 --output-json "$OUT/json/w5.json" ;;
    hybrid)
      python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gdn_decode.py \
        tests/kernels/test_hybrid_kernels_gpu.py tests/kernels/test_fused.py \
        tests/runtime/test_hybrid_gpu.py 2>&1 | tail -4
      python3 benchmarks/gdn_decode_bench.py --sweep --out "$OUT/json/gdn_decode.json" 2>&1 | grep -v -i warn | tail -30
      atom bench latency --load-format dummy --model $H4 --output-json "$OUT/json/w2_qwen3.5_4b.json" ;;
    mixed)
      python3 benchmarks/trace_mixed.py --model $H4 --out "$OUT/json/mixed_h4.json" 2>&1 | grep -v -i warn | head -60 ;;
    kvx)
      python3 -m pytest -q -p no:cacheprovider tests/runtime/test_kv_transfer.py 2>&1 | tail -3
      python3 benchmarks/pd_bench.py transfer --check --out "$OUT/json/pd_transfer.json" 2>&1 | grep -v -i warn
      python3 benchmarks/pd_bench.py transfer --streams 8 --out "$OUT/json/pd_transfer_s8.json" 2>&1 | grep -v -i warn ;;
    pdserve)
      python3 benchmarks/pd_bench.py serve --modes disaggregated --model $Q3 --rates 4,16 \
        --num-requests 32 --input-len 2048 --output-len 128 --out "$OUT/json/pd_serve_kvx.json" 2>&1 | grep -v -i warn ;;
    ckpt)
      python3 -m pytest -q -p no:cacheprovider tests/kernels/test_state_copy.py 2>&1 | tail -3
      python3 -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_state_checkpoints_engine.py \
        tests/runtime/test_state_checkpoints_maintenance.py 2>&1 | tail -4 ;;
    hybridparity)
      python3 -m pytest -q -p no:cacheprovider tests/runtime/test_hybrid_gpu.py -k "parity and qwen3_5 and not moe" 2>&1 | tail -3 ;;
    tracehybrid)
      python3 benchmarks/trace_decode.py --model $H4 --out "$OUT/json/trace_h4.json" 2>&1 | grep -v -i warn | head -32 ;;
    w4)
      python3 -m atom_runtime serve --load-format dummy --model $Q3 --port 8011 > "$OUT/w4_serve.log" 2>&1 &
      SERVE=$!
      # The bench's ready check retries while the server starts (--ready-check-timeout-sec).
      for rate in 16 64 inf; do
        atom bench serve --port 8011 --model $Q3 --dataset-name sharegpt --num-prompts 512 \
          --request-rate $rate --ignore-eos --disable-tqdm --result-filename "$OUT/json/w4_sharegpt_$rate.json"
      done
      # W1's shape at saturation: prompts in [100, 1024], outputs 512 +- 82% (the ratio is shared).
      atom bench serve --port 8011 --model $Q3 --dataset-name random --num-prompts 256 \
        --random-input-len 562 --random-range-ratio 0.82 --random-output-len 512 --ignore-eos \
        --disable-tqdm --result-filename "$OUT/json/w4_random_w1.json"
      kill -TERM $SERVE; wait $SERVE ;;
    w3graphs)
      # Issue 18 item 2: short prefill steps through captured graphs (tests, W3 with the graphs
      # and without them in the same call, where the cached request's time goes).
      python3 -m pytest -q -p no:cacheprovider tests/runtime/test_gpu_engine.py -k "prefill_graphs or short_chunk or graph_replay" 2>&1 | tail -3
      atom bench prefix --load-format dummy --model $Q3 --output-len 1 --at-once-requests 61 --output-json "$OUT/json/w3_max1_graphs.json"
      atom bench prefix --load-format dummy --model $Q3 --output-len 1 --modes single --caching on --prefill-graph-max-tokens 0 --output-json "$OUT/json/w3_max1_eager_prefill.json"
      python3 benchmarks/trace_prefix.py --model $Q3 --out "$OUT/json/trace_prefix.json" 2>&1 | grep -v -i warn | tail -30 ;;
    pdl)
      # Programmatic dependent launch: the GPU tests with it on, then W2 with it off and on,
      # alternating, in the same call (ATOM_PDL; atom_kernels/pdl.py).
      python3 -m pytest -q -p no:cacheprovider tests/runtime/test_gpu_engine.py -k "programmatic" 2>&1 | tail -3
      for model in $Q3 $L8 $H4; do
        for flag in 0 1; do
          ATOM_PDL=$flag atom bench latency --load-format dummy --model $model --output-json "$OUT/json/w2_pdl${flag}_$(basename $model).json"
        done
      done ;;
    w4http)
      # Issue 18 item 3: W1 through HTTP against W1 offline in the same run, with each server
      # process's CPU per streamed token and the gaps between chunks.
      python3 benchmarks/serve_cpu_cost.py --model $Q3 --offline --output-json "$OUT/json/w4_http_vs_offline.json" 2>&1 | grep -v -i warn | tail -30 ;;
    qknorm)
      # The qkv GEMV with QK-norm + rotary + cache store (and the input norm) fused: its compiled
      # tests, the engine's one-row paths, then W2 on both models and the 0.6B's step trace.
      python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gemv.py -k "qk_norm or rope" 2>&1 | tail -2
      python3 -m pytest -q -p no:cacheprovider tests/runtime/test_gpu_engine.py -k "one_row_paths or programmatic" 2>&1 | tail -2
      atom bench latency --load-format dummy --model $Q3 --output-json "$OUT/json/w2_qwen3_0.6b.json"
      python3 benchmarks/trace_decode.py --model $Q3 --out "$OUT/json/trace_q3.json" 2>&1 | grep -v -i warn | head -14
      atom bench latency --load-format dummy --model $L8 --output-json "$OUT/json/w2_llama_8b.json" ;;
    qksweep)
      # Why start-up keeps or drops the fused QK-norm qkv path: its launch shapes against cuBLAS +
      # QK-prep, the start-up's own timings (logged), and prefill attention by KV page size.
      python3 benchmarks/gemv_sweep.py --model $Q3 --paired --case qkv+qknorm+rope --out "$OUT/json/qk_sweep.json" 2>&1 | grep -v -i warn
      python3 -c "import logging; logging.basicConfig(level=logging.INFO); from atom_runtime import LLM; LLM('$Q3', load_format='dummy')" 2>&1 | grep 'one-row' | cut -c1-400
      python3 benchmarks/prefill_page_sweep.py --out "$OUT/json/prefill_pages.json" 2>&1 | grep -v -i warn ;;
    w2paths)
      # Decode attention's merge over live splits only (compiled tests, the batch-1 launch), then
      # W2 with the start-up's one-row choices against every group forced onto its fused GEMV.
      python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_kernels.py -k decode 2>&1 | tail -2
      python3 benchmarks/decode_b1_sweep.py --engine-only 2>&1 | grep -v -i warn
      atom bench latency --load-format dummy --model $Q3 --output-json "$OUT/json/w2_q3_auto.json"
      ATOM_SMALL_M_KERNELS=gemv atom bench latency --load-format dummy --model $Q3 --output-json "$OUT/json/w2_q3_gemv.json"
      atom bench latency --load-format dummy --model $L8 --output-json "$OUT/json/w2_l8_auto.json" ;;
    w2q3)
      atom bench latency --load-format dummy --model $Q3 --output-json "$OUT/json/w2_qwen3_0.6b.json" ;;
    w2checked)
      # The per-group timing alone (the default) against it plus the whole-step check
      # (ATOM_SMALL_M_KERNELS=checked), A/B/A on the 0.6B, A/B on the 8B.
      atom bench latency --load-format dummy --model $Q3 --output-json "$OUT/json/w2_q3_auto.json"
      ATOM_SMALL_M_KERNELS=checked atom bench latency --load-format dummy --model $Q3 --output-json "$OUT/json/w2_q3_checked.json"
      atom bench latency --load-format dummy --model $Q3 --output-json "$OUT/json/w2_q3_auto2.json"
      atom bench latency --load-format dummy --model $L8 --iters 2 --output-json "$OUT/json/w2_l8_auto.json"
      ATOM_SMALL_M_KERNELS=checked atom bench latency --load-format dummy --model $L8 --iters 2 --output-json "$OUT/json/w2_l8_checked.json" ;;
    b1attn)
      # Decode attention at batch 1: the engine's split + merge against other splits and tiles.
      python3 benchmarks/decode_b1_sweep.py --out "$OUT/json/decode_b1.json" 2>&1 | grep -v -i warn ;;
    gputests)
      # Every GPU engine test (dense and hybrid), log kept whole.
      python3 -m pytest -q -p no:cacheprovider tests/runtime/test_gpu_engine.py tests/runtime/test_hybrid_gpu.py > "$OUT/gputests.log" 2>&1
      tail -5 "$OUT/gputests.log" ;;
    gdnsplit)
      # The fused GDN decode kernel with Dv split across programs at small batches: compiled
      # tests, the split sweep, the hybrid GPU tests, W2 of the dense hybrid and its trace.
      python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gdn_decode.py 2>&1 | tail -2
      python3 benchmarks/gdn_decode_bench.py --batch 1,4,16 --sweep --out "$OUT/json/gdn_split.json" 2>&1 | grep -v -i warn | tail -40
      python3 -m pytest -q -p no:cacheprovider tests/runtime/test_hybrid_gpu.py 2>&1 | tail -2
      python3 -c "import logging; logging.basicConfig(level=logging.INFO); from atom_runtime import LLM; LLM('$H4', load_format='dummy')" 2>&1 | grep 'one-row' | cut -c1-400
      atom bench latency --load-format dummy --model $H4 --output-json "$OUT/json/w2_qwen3.5_4b.json"
      python3 benchmarks/trace_decode.py --model $H4 --out "$OUT/json/trace_h4.json" 2>&1 | grep -v -i warn | head -24 ;;
    early)
      # The GEMV loading its first ATOM_GEMV_EARLY columns before the PDL wait (0: one step,
      # as before): W2 on the dense hybrid, the 8B and the 0.6B, in one call.
      for model in $H4 $L8 $Q3; do
        for early in 0 512 1024; do
          echo "== $(basename $model) ATOM_GEMV_EARLY=$early"
          ATOM_GEMV_EARLY=$early atom bench latency --load-format dummy --model $model --output-json "$OUT/json/w2_$(basename $model)_early$early.json" 2>&1 | grep -i "W2:\|one-row\|error" | cut -c1-400 | head -4
        done
      done ;;
    w2early)
      # W2 on the three models with the GEMV's default 1,024 early columns, then 2,048 on the
      # hybrid and the 0.6B, then every GPU engine test.
      for model in $Q3 $L8 $H4; do
        echo "== $(basename $model) default"
        atom bench latency --load-format dummy --model $model --output-json "$OUT/json/w2_$(basename $model).json" 2>&1 | grep -i "W2:\|one-row\|error" | cut -c1-400 | head -4
      done
      for model in $H4 $Q3; do
        echo "== $(basename $model) ATOM_GEMV_EARLY=2048"
        ATOM_GEMV_EARLY=2048 atom bench latency --load-format dummy --model $model 2>&1 | grep -i "W2:\|one-row\|error" | cut -c1-400 | head -4
      done
      python3 -m pytest -q -p no:cacheprovider tests/runtime/test_gpu_engine.py tests/runtime/test_hybrid_gpu.py tests/kernels/test_gemv.py > "$OUT/gputests.log" 2>&1
      tail -5 "$OUT/gputests.log" ;;
    producernorm)
      # The residual add and the norm's sums of squares in the GEMV that writes the row, the
      # next GEMV norming from them (ATOM_NORM_IN_PRODUCER=1): W2 on the 8B and the hybrid with
      # it on, then off, each with its start-up choices; first its bf16 GPU test.
      [ "${PN_TEST:-1}" = 1 ] && python3 -m pytest -q -p no:cacheprovider tests/runtime/test_gpu_engine.py -k norm_in_the_producer 2>&1 | tail -2
      for model in $L8 $H4; do
        for on in 1 0; do
          echo "== $(basename $model) ATOM_NORM_IN_PRODUCER=$on"
          ATOM_NORM_IN_PRODUCER=$on python3 -c "import logging, sys; logging.basicConfig(level=logging.INFO); from atom_runtime.cli import main; sys.exit(main())" bench latency --load-format dummy --model $model 2>&1 | grep -i "W2:\|one-row paths\|projections (\|error" | sed "s/.*one-row/one-row/" | cut -c1-420 | head -10
        done
      done ;;
    producernorm2)
      # The norm-in-producer path's per-group start-up timings (every path, us per layer), then
      # W2 with every group forced onto its most fused path (ATOM_SMALL_M_KERNELS=gemv: the
      # consumers norm from the producers' sums) with it on and off, 8B and dense hybrid.
      for model in $L8 $H4; do
        echo "== $(basename $model) ATOM_NORM_IN_PRODUCER=1 auto"
        ATOM_NORM_IN_PRODUCER=1 python3 -c "import logging, sys; logging.basicConfig(level='INFO'); from atom_runtime.cli import main; sys.exit(main())" bench latency --load-format dummy --model $model 2>&1 | grep -i "W2:\|projections\|error" | sed 's/.*one-row/one-row/' | cut -c1-330
        for on in 1 0; do
          echo "== $(basename $model) ATOM_NORM_IN_PRODUCER=$on forced onto the GEMV"
          ATOM_SMALL_M_KERNELS=gemv ATOM_NORM_IN_PRODUCER=$on atom bench latency --load-format dummy --model $model 2>&1 | grep -i "W2:\|one-row paths\|error" | cut -c1-400 | head -3
        done
      done ;;
    pnlog)
      # The start-up's per-group one-row timings (every path, us per layer) with the
      # norm-in-producer paths offered, 8B and dense hybrid.
      for model in $L8 $H4; do
        ATOM_NORM_IN_PRODUCER=1 python3 -c "import logging; logging.basicConfig(level=logging.INFO); from atom_runtime import LLM; LLM('$model', load_format='dummy')" 2>&1 | grep 'one-row' | sed 's/.*one-row/one-row/' | cut -c1-400
      done ;;
    w2shapes)
      # W2 on the three models, the start-up's launch-shape timings and choices logged.
      for model in ${W2_MODELS:-$L8 $H4 $Q3}; do
        echo "== $(basename $model)"
        python3 -c "import logging, sys; logging.basicConfig(level=logging.INFO); from atom_runtime.cli import main; sys.exit(main())" bench latency --load-format dummy --model $model --output-json "$OUT/json/w2_$(basename $model).json" 2>&1 | grep -i "W2:\|launch shapes\|one-row paths\|error" | sed "s/.*one-row/one-row/" | cut -c1-420
      done ;;
    densecheck)
      # The dense prefill path as it ships (on by default): its GPU tests, then the first call at
      # new lengths after the start-up's plan warm-up.
      timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_kernels_gpu.py tests/runtime/test_gpu_engine.py -k "dense or fresh_prompts or cached_prefix_keeps or prefill_graphs" 2>&1 | tail -3
      timeout 100 python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import prefill_dense_bench as b; b.first_calls()" 2>&1 | grep -v -i "warn\|o = sdpa" | tail -14 ;;
    moegemv)
      # The MoE pair GEMV for one-token steps: its bf16 GPU test, then W2 of the 35B-A3B-shaped MoE
      # hybrid with it off and on, same call.
      python3 -m pytest -q -p no:cacheprovider tests/kernels/test_hybrid_kernels_gpu.py -k moe 2>&1 | tail -2
      for on in 0 1; do
        ATOM_MOE_GEMV=$on timeout 240 python3 -m atom_runtime bench latency --load-format dummy --model benchmarks/configs/qwen3.5-35b-a3b --output-json "$OUT/json/w2_35b_moe_gemv$on.json" 2>&1 | grep -i "W2:\|error" | cut -c1-300
      done
      # Where the MoE hybrid's batch-1 step goes, with the pair GEMV.
      ATOM_MOE_GEMV=1 timeout ${TRACE_CAP:-150} python3 benchmarks/trace_decode.py --model benchmarks/configs/qwen3.5-35b-a3b --out "$OUT/json/trace_35b.json" 2>&1 | grep -v -i warn | head -${TOP:-40} ;;
    moe2)
      # The MoE layer's router in one kernel and the shared expert stacked as expert E: the GPU
      # tests, W2 of the 35B-A3B MoE hybrid with the pair GEMV off and on, its W1, a trace.
      timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_hybrid_kernels_gpu.py -k "moe" 2>&1 | tail -3
      timeout 90 python3 benchmarks/moe_gemv_sweep.py --out "$OUT/json/moe_gemv_sweep.json" 2>&1 | grep -v -i warn | tail -16
      for on in 0 1; do
        ATOM_MOE_GEMV=$on timeout 150 python3 -m atom_runtime bench latency --load-format dummy --model benchmarks/configs/qwen3.5-35b-a3b --output-json "$OUT/json/w2_35b_moe2_gemv$on.json" 2>&1 | grep -i "W2:\|error" | cut -c1-300
      done
      ATOM_MOE_GEMV=1 timeout 110 python3 -m atom_runtime bench throughput --load-format dummy --model benchmarks/configs/qwen3.5-35b-a3b --output-json "$OUT/json/w1_35b_moe2.json" 2>&1 | grep -i "W1\|error" | cut -c1-300
      ATOM_MOE_GEMV=1 timeout 100 python3 benchmarks/trace_decode.py --model benchmarks/configs/qwen3.5-35b-a3b --out "$OUT/json/trace_35b_moe2.json" 2>&1 | grep -v -i warn | head -${TOP:-24} ;;
    moe3)
      # The pair GEMV with its launch shapes timed at start-up and down summing a token's pairs
      # in one pipelined loop, on by default: GPU tests, the shapes' table, W2 and a trace.
      timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_hybrid_kernels_gpu.py -k "moe" 2>&1 | tail -2
      timeout 150 python3 benchmarks/moe_gemv_sweep.py --tokens ${MOE_TOKENS:-1,2,4,8} --out "$OUT/json/moe_gemv_sweep3.json" 2>&1 | grep -v -i warn | tail -${SWEEP_LINES:-40}
      timeout 150 python3 -m atom_runtime bench latency --load-format dummy --model benchmarks/configs/qwen3.5-35b-a3b --output-json "$OUT/json/w2_35b_moe3.json" 2>&1 | grep -i "W2:\|error" | cut -c1-300
      timeout 110 python3 benchmarks/trace_decode.py --model benchmarks/configs/qwen3.5-35b-a3b --out "$OUT/json/trace_35b_moe3.json" 2>&1 | grep -v -i warn | head -${TOP:-14} ;;
    hybridgpu)
      # The hybrid GPU engine tests from cold: no Triton cache, tiny models built afresh.
      rm -rf ~/.triton/cache
      timeout 400 python3 -m pytest -q -p no:cacheprovider tests/runtime/test_hybrid_gpu.py tests/kernels/test_hybrid_kernels_gpu.py --tb=short 2>&1 | grep -E "^E |passed|failed" | head -20 | cut -c1-240 ;;
    w1ckpt)
      # The dense hybrid's W1 with state checkpoints off (interval 0) and at the default (-1).
      for iv in 0 -1; do
        timeout 150 python3 -m atom_runtime bench throughput --load-format dummy --model $H4 --state-checkpoint-interval-tokens $iv --output-json "$OUT/json/w1_h4_ckpt$iv.json" 2>&1 | grep -i "W1\|error" | cut -c1-300
      done ;;
    w1hybrid)
      # Issue 14 item 7: W1 of both hybrids against transformers, with the bandwidth bound.
      timeout 280 python3 -m atom_runtime bench throughput --load-format dummy --model $H4 --peer transformers --peer-num-prompts 16 --peer-batch-size 16 --output-json "$OUT/json/w1_h4.json" 2>&1 | grep -i "W1\|error" | cut -c1-300
      timeout 300 python3 -m atom_runtime bench throughput --load-format dummy --model benchmarks/configs/qwen3.5-35b-a3b --peer transformers --peer-num-prompts 16 --peer-batch-size 16 --output-json "$OUT/json/w1_35b.json" 2>&1 | grep -i "W1\|error" | cut -c1-300 ;;
    w1heads)
      # W1's decode attention (batch 256, 0.6B heads, 512-1,024-token contexts) by grid order and
      # launch settings, then W1 with the decode grid's KV heads fastest and without, same call.
      timeout 200 python3 benchmarks/kernels_bench.py --sweep w1 --sweep-only --out "$OUT/json/decode_w1.json" 2>&1 | grep -v -i warn | tail -16
      atom bench throughput --load-format dummy --model $Q3 --output-json "$OUT/json/w1_default.json" 2>&1 | grep -i "W1\|error" | cut -c1-300
      ATOM_DECODE_HEADS_FASTEST=1 atom bench throughput --load-format dummy --model $Q3 --output-json "$OUT/json/w1_heads_fastest.json" 2>&1 | grep -i "W1\|error" | cut -c1-300 ;;
    w1bal)
      # W1's decode attention over W1's spread of contexts, by program order (as batched, longest
      # first), grid order and split count: how much of its gap to the copy ceiling is the tail.
      timeout 200 python3 benchmarks/kernels_bench.py --sweep w1bal --sweep-only --out "$OUT/json/decode_w1bal.json" 2>&1 | grep -v -i warn | tail -${SWEEP_LINES:-40} ;;
    w1launch)
      # W1's decode attention over W1's spread of contexts by launch settings (programs an SM holds).
      timeout 200 python3 benchmarks/kernels_bench.py --sweep w1launch --sweep-only --out "$OUT/json/decode_w1launch.json" 2>&1 | grep -v -i warn | tail -${SWEEP_LINES:-45} ;;
    w1pack)
      # Two KV heads a decode program at large batch: the decode GPU tests, the kernel against one
      # head a program on W1's contexts, W1 and W2 (0.6B) with it off and on, same call.
      timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_kernels_gpu.py -k decode 2>&1 | tail -2
      timeout 150 python3 benchmarks/kernels_bench.py --sweep w1pack --sweep-only --out "$OUT/json/decode_w1pack.json" 2>&1 | grep -v -i warn | tail -30
      for on in 0 1; do
        ATOM_DECODE_PACK_HEADS=$on timeout 120 python3 -m atom_runtime bench throughput --load-format dummy --model $Q3 --output-json "$OUT/json/w1_pack$on.json" 2>&1 | grep -i "W1:\|error" | cut -c1-300
      done
      ATOM_DECODE_PACK_HEADS=1 timeout 100 python3 -m atom_runtime bench latency --load-format dummy --model $Q3 --output-json "$OUT/json/w2_q3_pack.json" 2>&1 | grep -i "W2:\|error" | cut -c1-300 ;;
    w1order)
      # W1 of Qwen3-0.6B with the decode grid's KV heads fastest off and on, same call.
      for hf in 0 1; do
        ATOM_DECODE_HEADS_FASTEST=$hf timeout 150 python3 -m atom_runtime bench throughput --load-format dummy --model $Q3 --output-json "$OUT/json/w1_heads_fastest$hf.json" 2>&1 | grep -i "W1\|error" | cut -c1-300
      done ;;
    w3dense)
      # W3 with the dense prefill path forced on for Qwen3-0.6B's narrow heads and off, same call:
      # its cold runs are fresh 8k-token prompts, which the dense path speeds up.
      ATOM_DENSE_PREFILL=1 timeout 200 python3 -m atom_runtime bench prefix --load-format dummy --model $Q3 --output-len 1 --at-once-requests 61 --output-json "$OUT/json/w3_dense_on.json" 2>&1 | grep -i "W3\|cached\|cold\|dense\|error" | cut -c1-300
      ATOM_DENSE_PREFILL=0 timeout 150 python3 -m atom_runtime bench prefix --load-format dummy --model $Q3 --output-len 1 --modes single --output-json "$OUT/json/w3_dense_off.json" 2>&1 | grep -i "W3\|cached\|cold\|error" | cut -c1-300 ;;
    densehost)
      # Host time per call of each way a lone fresh chunk can attend (the dense path's host cost).
      timeout 120 python3 benchmarks/prefill_dense_bench.py --host-cost --out "$OUT/json/dense_host.json" 2>&1 | grep -v -i "warn\|o = sdpa" ;;
    densettft)
      timeout ${TTFT_CAP:-120} python3 benchmarks/prefill_dense_bench.py --ttft ${TTFT_MODELS:-$L8,$Q3} ${TTFT_LENGTHS:+--ttft-lengths $TTFT_LENGTHS} --out "$OUT/json/prefill_dense_ttft.json" 2>&1 | grep "TTFT\|Error" ;;
    gputests4)
      # The GPU engine tests under a 4-minute cap (what finishes in it is reported).
      timeout ${GPUTESTS_CAP:-240} python3 -m pytest -v -p no:cacheprovider tests/runtime/test_gpu_engine.py tests/runtime/test_hybrid_gpu.py > "$OUT/gputests.log" 2>&1
      tail -5 "$OUT/gputests.log"; grep -c PASSED "$OUT/gputests.log" ;;
    crossover)
      # Dense prefill against the paged kernel by prompt length, per head config.
      (cd benchmarks && timeout 150 python3 dense_crossover.py --out "$OUT/json/dense_crossover.json" 2>&1 | grep -v -i "warn\|o = sdpa") ;;
    denseprofile)
      # Why a 5,003-token prompt of Qwen3-0.6B was slower with the dense prefill path (26.7 against
      # 19.5 ms) when its kernel alone is faster: the step's kernels, dense on and off.
      timeout 240 python3 benchmarks/trace_fresh_prefill.py --model ${PROFILE_MODEL:-$Q3} --lengths ${PROFILE_LENGTHS:-5003,8192} --top ${PROFILE_TOP:-12} --out "$OUT/json/trace_fresh_prefill.json" 2>&1 | grep -v -i "warn" | cut -c1-260 | tail -${PROFILE_LINES:-70} ;;
    skipnorm)
      # Bound on the norm lever: W2 with the one-row RMSNorms skipped (benchmarks/skip_norm_bound.py,
      # numerics wrong, timing only) against the real step, dense hybrid and 8B.
      for model in $H4 $L8; do
        echo "== $(basename $model) real"
        atom bench latency --load-format dummy --model $model 2>&1 | grep -i "W2:\|one-row\|error" | cut -c1-400 | head -4
        echo "== $(basename $model) norms skipped"
        python3 benchmarks/skip_norm_bound.py bench latency --load-format dummy --model $model 2>&1 | grep -i "W2:\|one-row\|error" | cut -c1-400 | head -4
      done ;;
    w2all)
      # W2 on the three models with the start-up's one-row choices (GEMV launch shapes included).
      for model in $Q3 $L8 $H4; do
        python3 -c "import logging; logging.basicConfig(level=logging.INFO); from atom_runtime import LLM; LLM('$model', load_format='dummy')" 2>&1 | grep 'one-row' | cut -c1-300
        atom bench latency --load-format dummy --model $model --output-json "$OUT/json/w2_$(basename $model).json"
      done ;;
    gdnload)
      # The fused GDN decode with every load issued first: compiled tests, sweep, hybrid W2 and
      # trace, decode attention at the hybrid's head_dim 256.
      python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gdn_decode.py 2>&1 | tail -2
      python3 benchmarks/gdn_decode_bench.py --batch 1,4,16 --sweep --out "$OUT/json/gdn_load.json" 2>&1 | grep -v -i warn | grep "gdn\|saves"
      atom bench latency --load-format dummy --model $H4 --output-json "$OUT/json/w2_qwen3.5_4b.json"
      python3 benchmarks/trace_decode.py --model $H4 --out "$OUT/json/trace_h4.json" 2>&1 | grep -v -i warn | head -24
      python3 benchmarks/decode_b1_sweep.py --models qwen3.5-4b --out "$OUT/json/decode_b1_h4.json" 2>&1 | grep -v -i warn | head -80 ;;
    gemvh4)
      # The plain GEMV's launch shapes on the dense hybrid's projections (K 2560).
      python3 benchmarks/gemv_sweep.py --model $H4 --small-grid --layers 16 \
        --shapes 12352x2560,18432x2560,2560x9216,2560x4096,10240x2560 --out "$OUT/json/gemv_h4.json" 2>&1 | grep -v -i warn ;;
    hybridpeer)
      # Issue 14 item 7: W2 of the dense hybrid with its transformers peer (dynamic cache).
      atom bench latency --load-format dummy --model $H4 --peer transformers --output-json "$OUT/json/w2_qwen3.5_4b_peer.json" ;;
  esac
done

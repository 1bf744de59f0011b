#!/usr/bin/env bash
# The GPU check-and-measure cycle on one H200, in one go: kernel tests compiled for real (bf16,
# fp16), engine parity on the GPU, W2 and W1 for ATOM, kernel microbenchmarks, then the peer.
# Usage (from the repository root, on the GPU machine): OUT=results bash benchmarks/run_h200.sh [stage...]
# Python packages the image lacks travel as wheels in .whl/ (see docs/benchmarks.md).
set -uo pipefail
OUT=${OUT:-results}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=$PWD/runtime:$PWD/kernels:$PWD/operator:$PWD:/tmp/site
export PYTHONUNBUFFERED=1 ATOM_REPORT_DIR=$OUT
stages=${*:-tests bench}
atom() { python3 -m atom_runtime "$@"; }
for stage in $stages; do
  case $stage in
    tests)
      nvidia-smi -L | tee "$OUT/gpu.txt"
      python3 -m pytest -q -p no:cacheprovider tests/kernels tests/runtime/test_gpu_engine.py 2>&1 | tail -40 | tee "$OUT/gpu_tests.log" ;;
    bench)
      atom bench latency --load-format dummy --model benchmarks/configs/qwen3-0.6b --output-json "$OUT/w2_qwen3_0.6b.json" 2>&1 | grep -v Warning
      atom bench latency --load-format dummy --model benchmarks/configs/llama-3.1-8b --output-json "$OUT/w2_llama_8b.json" 2>&1 | grep -v Warning
      atom bench throughput --load-format dummy --model benchmarks/configs/qwen3-0.6b --output-json "$OUT/w1_qwen3_0.6b.json" 2>&1 | grep -v Warning
      python3 benchmarks/kernels_bench.py --out "$OUT/kernels.json" 2>&1 | tail -20 ;;
    peer)
      atom bench latency --load-format dummy --model benchmarks/configs/qwen3-0.6b --peer transformers --output-json "$OUT/w2_qwen3_0.6b_peer.json" 2>&1 | grep -v Warning
      atom bench throughput --load-format dummy --model benchmarks/configs/qwen3-0.6b --peer transformers --peer-num-prompts 64 --output-json "$OUT/w1_qwen3_0.6b_peer.json" 2>&1 | grep -v Warning ;;
    peer8b)
      atom bench latency --load-format dummy --model benchmarks/configs/llama-3.1-8b --peer transformers --output-json "$OUT/w2_llama_8b_peer.json" 2>&1 | grep -v Warning ;;
  esac
done

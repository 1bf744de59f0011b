"""`atom bench` on a machine without a GPU: every offline subcommand runs on CPU at small sizes, or
says in one line why it cannot; never a traceback. Real subprocesses of the installed CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ATOM = Path(sys.executable).parent / "atom"
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="pins the CPU-only behaviour")


def atom(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(ATOM), "bench", *args], capture_output=True, text=True, timeout=300)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    return proc


@no_gpu
def test_throughput_and_latency_run_on_cpu(tiny_models, tmp_path):
    model = str(tiny_models["llama"])
    out = tmp_path / "w1.json"
    proc = atom(
        *("throughput", "--model", model, "--num-prompts", "3", "--input-len-min", "4"),
        *("--input-len-max", "12", "--output-len", "3", "--output-json", str(out)),
    )
    assert proc.returncode == 0, proc.stderr
    assert "no GPU here, running on CPU" in proc.stderr
    r = json.loads(out.read_text())
    assert r["device"] == "cpu" and r["output_tokens"] == 9 and r["output_tokens_per_s"] > 0
    # The bound at this machine's copy bandwidth (no peak figure on CPU): above what ran.
    assert "bound W1:" in proc.stdout and "(copy)" in proc.stdout
    assert "peak" not in r["bound"] and 0 < r["bound"]["copy"]["atom_share_of_bound"] < 1
    assert r["bound"]["copy"]["bound"] > r["output_tokens_per_s"]
    out = tmp_path / "w2.json"
    proc = atom(
        *("latency", "--model", model, "--input-len", "8", "--output-len", "5"),
        *("--output-json", str(out)),
    )
    assert proc.returncode == 0, proc.stderr
    assert "atom  W2:" in proc.stdout and "bound W2:" in proc.stdout
    r = json.loads(out.read_text())
    assert 0 < r["bound"]["copy"]["bound"] < r["ms_per_token"]


@no_gpu
def test_prefix_runs_on_cpu_and_the_cache_serves_the_prefix(tiny_models, tmp_path):
    out = tmp_path / "w3.json"
    proc = atom(
        *("prefix", "--model", str(tiny_models["llama"]), "--prefix-len", "96"),
        *("--suffix-len", "8", "--output-len", "2", "--num-requests", "3"),
        *("--at-once-requests", "2", "--output-json", str(out)),
    )
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())
    on, off = r["caching_on"], r["caching_off"]
    for mode, n in (("single", 3), ("at_once", 2)):
        assert on[mode]["num_requests"] == off[mode]["num_requests"] == n
        assert len(on[mode]["ttfts_ms"]) == n
        assert on[mode]["ttft_p50_ms"] > 0 and off[mode]["ttft_p50_ms"] > 0
        assert r[f"{mode}_ratio"] == on[mode]["ttft_p50_ms"] / off[mode]["ttft_p50_ms"]
    # 96 prefix tokens = 6 blocks of 16, served from the cache to each of the 5 measured
    # requests of 104 tokens; the warm-up request (104 tokens) found nothing cached.
    assert on["prefix_hit_rate"] == pytest.approx(5 * 96 / (6 * 104))
    assert off["prefix_hit_rate"] == 0.0


def test_admission_only_needs_no_model():
    proc = atom("prefix", "--admission-only", "--prefix-len", "800")
    assert proc.returncode == 0, proc.stderr
    assert "admission over a cached 800-token prefix (block 16, 64 new tokens)" in proc.stdout


@no_gpu
def test_a_gpu_device_on_a_cpu_machine_is_one_clear_line(tiny_models):
    proc = atom("throughput", "--model", str(tiny_models["llama"]), "--device", "cuda")
    assert proc.returncode == 1
    assert "--device cuda: no CUDA or ROCm GPU is visible here" in proc.stderr


def test_bad_input_is_one_clear_line(tiny_models, tmp_path):
    proc = atom("latency", "--model", str(tmp_path / "missing"), "--device", "cpu")
    assert proc.returncode == 1 and "atom bench latency: error:" in proc.stderr
    assert "no such file or folder" in proc.stderr
    proc = atom("prefix", "--model", str(tiny_models["llama"]), "--prefix-len", "5000")
    assert proc.returncode == 1
    assert "exceed the engine's context" in proc.stderr


@no_gpu
def test_latency_peer_of_a_hybrid_model_uses_the_dynamic_cache(tiny_hybrid_models, tmp_path):
    """--peer-cache auto: transformers' static-cache compile of a hybrid model did not finish in
    minutes on the H200, so a hybrid model's peer runs its default (dynamic) cache."""
    out = tmp_path / "w2.json"
    proc = atom(
        *("latency", "--model", str(tiny_hybrid_models["qwen3_5"]), "--input-len", "8"),
        *("--output-len", "4", "--iters", "1", "--peer", "transformers"),
        *("--output-json", str(out)),
    )
    assert proc.returncode == 0, proc.stderr
    peer = json.loads(out.read_text())["peer"]
    assert peer["cache"] == "dynamic" and peer["ms_per_token"] > 0
    assert "peer W2:" in proc.stdout and "dynamic cache, eager" in proc.stdout

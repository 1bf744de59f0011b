"""`atom bench` with `--speculative-config` on CPU (a tiny Qwen3.5 with an MTP layer, real
subprocesses of the installed CLI): the W7 step-cost sweep's table and JSON, and the acceptance
counters beside W1 and W2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ATOM = Path(sys.executable).parent / "atom"
MTP = '{"method": "mtp", "num_speculative_tokens": 2}'


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    from tests.model_factory import make_tiny_model

    return make_tiny_model(
        tmp_path_factory.mktemp("bench_mtp") / "qwen3_5", "qwen3_5", mtp_layers=1
    )


def _bench(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(ATOM), "bench", *args], capture_output=True, text=True, timeout=600)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    assert proc.returncode == 0, proc.stderr
    return proc


def test_spec_cost_sweep_times_every_k_and_keeps_its_drafts_out_of_the_acceptance(
    mtp_model, tmp_path
):
    out = tmp_path / "w7.json"
    proc = _bench(
        *("latency", "--model", str(mtp_model), "--dtype", "float32", "--input-len", "8"),
        *("--output-len", "8", "--iters", "1", "--num-gpu-blocks-override", "32"),
        *("--speculative-config", MTP, "--spec-cost-sweep", "--output-json", str(out)),
    )
    r = json.loads(out.read_text())
    sweep = r["spec_cost_sweep"]
    assert [row["k"] for row in sweep["rows"]] == [0, 1, 2]
    assert sweep["plain_step_ms"] == sweep["rows"][0]["step_ms"] > 0
    for row in sweep["rows"][1:]:
        assert row["draft_ms"] > 0 and row["verify_ms"] > 0  # the MTP head ran, then the verify
        for a in (0.6, 0.8, 0.9):
            tokens = (1 - a ** (row["k"] + 1)) / (1 - a)
            assert row[f"ms_per_token_a{a}"] == pytest.approx(row["step_ms"] / tokens)
    assert "W7 cost sweep (mtp)" in proc.stdout and "ms/tok@0.8" in proc.stdout
    # The W2 run after the sweep: its own drafts only (one request of 8 tokens: at most 7 verify
    # steps of 2 drafts), not the sweep's random ones.
    acc = r["speculative"]
    assert 0 < acc["num_drafts"] <= 7 and acc["num_draft_tokens"] <= 2 * acc["num_drafts"]
    assert acc["num_emitted_tokens"] == acc["num_accepted_tokens"] + acc["num_drafts"]
    assert "atom  W7: mtp, k = 2" in proc.stdout and r["ms_per_token"] > 0


def test_throughput_prints_the_acceptance_beside_w1(mtp_model, tmp_path):
    out = tmp_path / "w1.json"
    proc = _bench(
        *("throughput", "--model", str(mtp_model), "--dtype", "float32", "--num-prompts", "2"),
        *("--input-len-min", "4", "--input-len-max", "8", "--output-len", "6"),
        *("--num-gpu-blocks-override", "32", "--speculative-config", MTP),
        *("--output-json", str(out)),
    )
    r = json.loads(out.read_text())
    assert r["output_tokens"] == 12
    assert r["speculative"]["num_drafts"] > 0
    assert "atom  W7: mtp, k = 2" in proc.stdout

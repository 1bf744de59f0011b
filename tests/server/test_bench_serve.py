"""`atom bench serve` against a real `atom serve` (tiny random Llama on CPU), and its pure parts:
arrivals, metric definitions, datasets."""

from __future__ import annotations

import json
import math
import re
import subprocess
import time

import httpx
import numpy as np
import pytest

from atom_runtime.bench import serve_client as bsc
from atom_runtime.bench import serve_datasets as bsd
from atom_runtime.bench import serve_metrics as bsm
from atom_runtime.bench.processes import ATOM
from atom_runtime.cli import main as atom_main
from tests.server.conftest import free_port

# vLLM's `vllm bench serve` result keys (vllm/benchmarks/serve.py), for the default metrics.
VLLM_KEYS = {
    "date",
    "endpoint_type",
    "model_id",
    "tokenizer_id",
    "num_prompts",
    "request_rate",
    "burstiness",
    "max_concurrency",
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "max_output_tokens_per_s",
    "max_concurrent_requests",
} | {
    f"{stat}_{m}_ms"
    for m in ("ttft", "tpot", "itl")
    for stat in ("mean", "median", "std", "p90", "p99")
}


def server_counter(server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    return float(re.search(rf"^{re.escape(name)} (\S+)$", text, re.M).group(1))


def wait_for(predicate, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def bench(server, model_name, tmp_path, *flags: str) -> dict:
    """Run `atom bench serve` in-process; model_name None leaves the model to the server."""
    out = tmp_path / "result.json"
    argv = ["bench", "serve", "--base-url", server.url]
    argv += ["--model", model_name] if model_name else []
    argv += ["--disable-tqdm", "--result-filename", str(out), "--save-result", *flags]
    assert atom_main(argv) == 0
    return json.loads(out.read_text())


def test_numbers_are_consistent_with_the_server(server, model_name, tmp_path):
    before = server_counter(server, "atom:generation_tokens_total")
    r = bench(
        server,
        model_name,
        tmp_path,
        *("--num-prompts", "6", "--random-input-len", "12", "--random-range-ratio", "0.5"),
        *("--random-output-len", "4", "--ignore-eos", "--request-rate", "50", "--seed", "3"),
        "--save-detailed",
    )
    assert VLLM_KEYS <= r.keys()
    assert r["completed"] == 6 and r["failed"] == 0 and r["num_prompts"] == 6
    assert r["request_rate"] == 50.0 and r["burstiness"] == 1.0
    # Input lengths are the sampled token-id prompts, which the server reports back in usage.
    samples = bsd.sample_random(bsd.load_token_source(model_name), 6, 12, 4, 0.5, 0, 3)
    assert r["input_lens"] == [s.prompt_len for s in samples]
    assert r["total_input_tokens"] == sum(s.prompt_len for s in samples)
    # ignore_eos: every request generates its sampled max_tokens (the range ratio applies to
    # output lengths too); the server's own counter agrees (it also counts the initial test
    # request, which sends the first sample).
    want = [s.expected_output_len for s in samples]
    assert r["output_lens"] == want and r["total_output_tokens"] == sum(want)
    wait_for(
        lambda: (
            server_counter(server, "atom:generation_tokens_total") - before == sum(want) + want[0]
        ),
        what="the server's generation counter to count the run's tokens",
    )
    for key in ("request_throughput", "output_throughput", "total_token_throughput"):
        assert r[key] > 0
    assert r["output_throughput"] == pytest.approx(sum(want) / r["duration"])
    assert r["request_goodput"] is None  # no --goodput given
    for m in ("ttft", "tpot", "itl"):
        assert 0 < r[f"median_{m}_ms"] <= r[f"p90_{m}_ms"] <= r[f"p99_{m}_ms"]
    # One gap between consecutive streamed chunks: at most one per token after the first (a
    # client that fell behind gets several tokens in one chunk, so only the bound is exact).
    assert all(0 <= len(itl) <= n - 1 for itl, n in zip(r["itls"], want, strict=True))
    assert all(t > 0 for t in r["ttfts"]) and all(e == "" for e in r["errors"])


def test_max_concurrency_is_honoured(server, model_name, tmp_path):
    r = bench(
        server,
        None,  # the server's first model, whose folder also gives the tokenizer
        tmp_path,
        *("--num-prompts", "6", "--random-input-len", "8", "--random-output-len", "3"),
        *("--max-concurrency", "2", "--ignore-eos"),
    )
    assert r["completed"] == 6 and r["max_concurrency"] == 2
    assert r["model_id"] == model_name and r["tokenizer_id"] == model_name
    # Recount from the per-request send times and latencies: at most two in flight, ever.
    events = sorted(
        [(s, 1) for s in r["start_times"]]
        + [(s + lat, -1) for s, lat in zip(r["start_times"], r["latencies"], strict=True)]
    )
    live, peak = 0, 0
    for _, d in events:
        live += d
        peak = max(peak, live)
    assert peak == r["max_concurrent_requests"] == 2
    # With no rate limit, requests beyond the first two queued client-side for a slot.
    assert sum(q > 0 for q in r["queue_times"]) >= 4


def test_a_failed_request_is_counted_not_fatal(server, model_name, tmp_path):
    data = tmp_path / "prompts.jsonl"
    rows = [
        {"prompt": "Hello there"},
        {"prompt": "Tell me a story", "output_tokens": 100000},  # beyond the context: HTTP 400
        {"prompt": "One more"},
    ]
    data.write_text("\n".join(json.dumps(x) for x in rows) + "\n")
    r = bench(
        server,
        model_name,
        tmp_path,
        *("--dataset-name", "custom", "--dataset-path", str(data), "--num-prompts", "3"),
        *("--custom-output-len", "3", "--save-detailed"),
    )
    assert r["completed"] == 2 and r["failed"] == 1
    assert r["errors"][0] == "" and r["errors"][2] == ""
    assert r["errors"][1].startswith("HTTP 400") and "max_tokens" in r["errors"][1]
    assert r["output_lens"][1] == 0 and r["input_lens"][0] > 0


def test_chat_backend_with_sharegpt_mix_and_goodput(server, model_name, tmp_path):
    r = bench(
        server,
        model_name,
        tmp_path,
        *("--backend", "openai-chat", "--dataset-name", "sharegpt", "--num-prompts", "3"),
        *("--sharegpt-output-len", "4", "--ignore-eos", "--goodput", "ttft:1e9", "e2el:0"),
        *("--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,99"),
    )
    assert r["endpoint_type"] == "openai-chat" and r["completed"] == 3
    assert r["total_output_tokens"] == 12
    assert r["request_goodput"] == 0.0  # nothing finishes in 0 ms end to end
    assert r["median_ttft_ms"] == pytest.approx(r["p50_ttft_ms"])
    assert "p99_e2el_ms" in r and "mean_itl_ms" not in r


def test_unreachable_server_is_one_clear_line(tiny_models, tmp_path):
    port = free_port()
    argv = [str(ATOM), "bench", "serve", "--port", str(port), "--model", "m"]
    argv += ["--tokenizer", str(tiny_models["llama"]), "--num-prompts", "2"]
    proc = subprocess.run(
        [*argv, "--ready-check-timeout-sec", "0"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1
    assert f"cannot reach http://127.0.0.1:{port}" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_bad_arguments_are_named():
    with pytest.raises(bsd.BenchError, match="--goodput 'ttft'"):
        bsm.parse_goodput(["ttft"])
    with pytest.raises(bsd.BenchError, match="KEY must be one of"):
        bsm.parse_goodput(["itl:5"])
    assert bsm.parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    with pytest.raises(bsd.BenchError, match="--random-range-ratio"):
        bsd.sample_random(bsd.TokenSource(None, 1000, "x"), 2, 10, 5, 1.0, 0, 0)
    with pytest.raises(bsd.BenchError, match="vocabulary"):
        bsd.sample_random(bsd.TokenSource(None, None, "x"), 2, 10, 5, 0.0, 0, 0)


# -- pure parts ----------------------------------------------------------------------------------


def test_poisson_and_gamma_arrivals():
    n, rate = 4000, 8.0
    poisson = np.diff([0.0, *bsc.arrival_offsets(n, rate, 1.0, seed=1)])
    smooth = np.diff([0.0, *bsc.arrival_offsets(n, rate, 4.0, seed=1)])
    # Rescaled like vLLM's: the last request goes out at n / rate exactly.
    assert sum(poisson) == pytest.approx(n / rate) and sum(smooth) == pytest.approx(n / rate)
    # Exponential gaps have a coefficient of variation of 1; gamma(shape k) has 1/sqrt(k).
    assert np.std(poisson) / np.mean(poisson) == pytest.approx(1.0, abs=0.06)
    assert np.std(smooth) / np.mean(smooth) == pytest.approx(0.5, abs=0.04)
    assert bsc.arrival_offsets(5, math.inf, 1.0, 0) == [0.0] * 5
    assert bsc.arrival_offsets(4, 2.0, math.inf, 0) == pytest.approx([0.5, 1.0, 1.5, 2.0])
    assert bsc.arrival_offsets(50, 3.0, 1.0, 7) == bsc.arrival_offsets(50, 3.0, 1.0, 7)


def test_metric_definitions_match_vllm():
    def out(ttft, itl, tokens, start=0.0, ok=True):
        return bsc.RequestOutput(
            success=ok,
            prompt_len=10,
            output_tokens=tokens,
            ttft=ttft,
            itl=itl,
            latency=ttft + sum(itl),
            start_time=start,
        )

    # Request a: 5 tokens in 3 chunks (2 tokens bundled twice); b: one token; c failed.
    outs = [out(0.1, [0.2, 0.3], 5), out(0.4, [], 1, start=0.05), out(0, [], 0, ok=False)]
    r = bsm.calculate_metrics(outs, 2.0, [50.0, 99.0], ["ttft", "tpot", "itl", "e2el"], {})
    assert r["completed"] == 2 and r["failed"] == 1
    assert r["total_output_tokens"] == 6 and r["total_input_tokens"] == 20
    assert r["output_throughput"] == 3.0 and r["request_throughput"] == 1.0
    # TPOT excludes the first token and skips one-token requests: (0.6 - 0.1) / 4.
    assert r["mean_tpot_ms"] == pytest.approx(125.0)
    # ITL is per chunk, not per token.
    assert r["mean_itl_ms"] == pytest.approx(250.0)
    assert r["mean_ttft_ms"] == pytest.approx(250.0) and r["p50_ttft_ms"] == pytest.approx(250.0)
    assert r["mean_e2el_ms"] == pytest.approx(500.0)
    assert r["max_concurrent_requests"] == 2
    good = bsm.calculate_metrics(outs, 2.0, [99.0], ["ttft"], {"ttft": 200.0, "tpot": 130.0})
    assert good["request_goodput"] == 0.5  # a meets both; b's TTFT is 400 ms
    # A one-token request counts TPOT 0 for goodput, as vLLM does.
    assert bsm.calculate_metrics(outs, 2.0, [99.0], ["ttft"], {"tpot": 1.0})[
        "request_goodput"
    ] == pytest.approx(0.5)


def test_datasets_are_seeded_and_shaped():
    src = bsd.TokenSource(None, 49152, "x")
    a = bsd.sample_random(src, 50, 100, 20, 0.25, 8, seed=5)
    assert a == bsd.sample_random(src, 50, 100, 20, 0.25, 8, seed=5)
    assert all(83 <= s.prompt_len <= 133 and 15 <= s.expected_output_len <= 25 for s in a)
    assert all(len(s.prompt) == s.prompt_len for s in a)
    assert len({tuple(s.prompt[:8]) for s in a}) == 1  # the shared random prefix
    assert all(100 <= t < 49152 for s in a for t in s.prompt)
    mix = bsd.sample_sharegpt_synthetic(src, 400, None, seed=0)
    plens = [s.prompt_len for s in mix]
    olens = [s.expected_output_len for s in mix]
    assert all(
        4 <= p <= 1024 and o >= 4 and p + o <= 2048 for p, o in zip(plens, olens, strict=True)
    )
    assert 60 < np.median(plens) < 200 and 80 < np.median(olens) < 260  # skewed, long-tailed
    assert max(plens) > 4 * np.median(plens)
    assert mix == bsd.sample_sharegpt_synthetic(src, 400, None, seed=0)


def test_sharegpt_file_is_read_tokenized_and_filtered(tiny_models, tmp_path):
    src = bsd.load_token_source(str(tiny_models["llama"]))
    assert src.tokenizer is not None and src.vocab_size == 49152
    words = "the quick brown fox jumps over the lazy dog "
    data = [
        {"conversations": [{"value": words * 3}, {"value": words * 2}]},
        {"conversations": [{"value": "hi"}, {"value": words}]},  # prompt under 4 tokens: dropped
        {"conversations": [{"value": words * 200}, {"value": words}]},  # prompt over 1024
        {"conversations": [{"value": words}]},  # no reply: dropped
        {"conversations": [{"value": words * 4}, {"value": words * 5}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    got = bsd.sample_sharegpt_file(src, str(path), 2, None, seed=0)
    tok = src.tokenizer
    assert sorted(s.prompt for s in got) == sorted([words * 3, words * 4])
    for s in got:
        assert s.prompt_len == len(tok.encode(s.prompt))
        reply = words * (2 if s.prompt == words * 3 else 5)
        assert s.expected_output_len == len(tok.encode(reply))
    with pytest.raises(bsd.BenchError, match="only 2 usable conversations, need 3"):
        bsd.sample_sharegpt_file(src, str(path), 3, None, seed=0)
    fixed = bsd.sample_sharegpt_file(src, str(path), 2, 7, seed=0)
    assert [s.expected_output_len for s in fixed] == [7, 7]


def test_a_server_without_usage_is_counted_from_the_text(server, model_name):
    """A server that ignores stream_options sends no usage; the output tokens are then counted
    by tokenizing the generated text (vLLM's fallback), or one per chunk without a tokenizer."""
    import asyncio

    sample = bsd.SampleRequest("Once upon a time", 0, 5)
    body = bsc.build_payload("openai", model_name, sample, True, 0.0)
    del body["stream_options"]  # the server then streams no usage chunk

    async def go() -> bsc.RequestOutput:
        async with httpx.AsyncClient(timeout=60) as client:
            return await bsc.send_request(client, f"{server.url}/v1/completions", body, sample)

    out = asyncio.run(go())
    # Five tokens come as at most five chunks (one ITL gap between each two); how many share a
    # chunk depends on how far the client fell behind the server, so only the bound is exact.
    assert out.success and out.output_tokens == 0 and 1 <= len(out.itl) <= 4
    src = bsd.load_token_source(model_name)
    assert bsc.count_missing_usage([out], src) == 1
    assert out.output_tokens == len(src.tokenizer.encode(out.generated_text, False))
    again = asyncio.run(go())
    assert bsc.count_missing_usage([again], bsd.TokenSource(None, None, None)) == 1
    assert again.output_tokens == len(again.itl) + 1 <= 5  # one per chunk

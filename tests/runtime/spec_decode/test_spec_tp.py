"""Drafting models under tensor parallelism (real worker processes; gloo on CPU, NCCL on GPUs):
the drafter runs whole on rank 0 and greedy output stays the plain engine's at TP 2, for a dense
draft model and a hybrid model's MTP head; a draft of another TP size is refused by name
before any process starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from atom_runtime import LLM, SamplingParams, envs
from atom_runtime.config import EngineConfig

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("no_leftover_tp_workers")]

K = 3
PROMPTS = [[11, 22, 33, 44, 55, 11, 22, 33, 44, 55, 11, 22], list(range(100, 137)), [9, 8, 7]]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
CPU = dict(dtype="float32", device="cpu", num_gpu_blocks_override=96)
GPU = dict(dtype="float32", gpu_memory_utilization=0.3)


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    from tests.model_factory import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tp_mtp") / "qwen3_5", "qwen3_5", mtp_layers=1)


@pytest.fixture(scope="module")
def deepseek_mtp_model(tmp_path_factory):
    from tests.model_factory import make_tiny_model

    # Four heads, two a rank.
    return make_tiny_model(
        tmp_path_factory.mktemp("tp_ds_mtp"), "deepseek_v3", mtp_layers=1, num_attention_heads=4,
        num_key_value_heads=4,
    )  # fmt: skip


def _ids(model, tp: int, spec=None, drafts=None, **kw) -> tuple[list[list[int]], object]:
    """Greedy ids of PROMPTS and the speculation stats; `drafts`, a list, collects every
    proposal rank 0's executor makes."""
    llm = LLM(str(model), tensor_parallel_size=tp, speculative_config=spec, **kw)
    try:
        if drafts is not None:
            executor = llm.engine.executor
            propose = executor.propose
            executor.propose = lambda seqs, record: (
                drafts.append(propose(seqs, record)) or drafts[-1]
            )
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        stats = llm.engine.scheduler.spec_stats if spec else None
        return [o.outputs[0].token_ids for o in outs], stats
    finally:
        llm.shutdown()


def _check(model, spec, drafts=None, **kw):
    want, _ = _ids(model, 1, **kw)
    got, stats = _ids(model, 2, spec, drafts, **kw)
    assert got == want
    assert stats.num_draft_tokens > 0
    return stats


def test_tp2_draft_model_keeps_greedy_output(tiny_models):
    # The target's own weights as the draft: every draft is accepted, so a drafter that ran
    # sharded or read a wrong cache would show as rejections.
    spec = {"model": str(tiny_models["qwen2"]), "num_speculative_tokens": K}
    assert _check(tiny_models["qwen2"], spec, **CPU).acceptance_rate == 1.0
    other = {"model": str(tiny_models["llama"]), "num_speculative_tokens": K}
    _check(tiny_models["qwen2"], other, **CPU)


def test_tp2_mtp_keeps_greedy_output_and_drafts_what_one_rank_drafts(mtp_model):
    # The whole-vocabulary copy on rank 0 and the gathered hidden states must give the
    # single-rank head's proposals, step for step.
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    one, tp = [], []
    _ids(mtp_model, 1, spec, drafts=one, **CPU)
    _check(mtp_model, spec, drafts=tp, **CPU)
    assert tp == one and any(any(d) for d in one)


def test_tp2_deepseek_mtp_keeps_greedy_output_and_drafts_what_one_rank_drafts(
    deepseek_mtp_model,
):
    # DeepSeek's head reads the target's rotary table and parameter names beside the
    # whole-vocabulary copy (MLA latent KV on rank 0).
    spec = {"method": "deepseek_mtp", "num_speculative_tokens": 2}
    one, tp = [], []
    _ids(deepseek_mtp_model, 1, spec, drafts=one, **CPU)
    _check(deepseek_mtp_model, spec, drafts=tp, **CPU)
    assert tp == one and any(any(d) for d in one)


def test_tp2_kv_blocks_are_what_rank_0_fits_beside_its_draft(tiny_models, monkeypatch):
    # Rank 0 holds the draft's KV too: its blocks are larger, so it decides the count.
    monkeypatch.setenv(envs.CPU_KVCACHE_SPACE.name, "0.002")
    space = 0.002 * (1 << 30)
    spec = {"model": str(tiny_models["llama"]), "num_speculative_tokens": 2}
    blocks = {}
    for name, speculative in (("plain", None), ("draft", spec)):
        llm = LLM(str(tiny_models["qwen2"]), dtype="float32", device="cpu",
                  tensor_parallel_size=2, speculative_config=speculative)  # fmt: skip
        try:
            runner = llm.engine.executor.runner
            assert runner.num_blocks == int(space // runner.bytes_per_block)
            blocks[name] = runner.num_blocks
        finally:
            llm.shutdown()
    assert blocks["draft"] < blocks["plain"]


@pytest.mark.parametrize("draft_tp", [2, 0])
def test_a_draft_tp_size_other_than_1_is_refused_by_name(tiny_models, draft_tp):
    spec = {"model": str(tiny_models["llama"]), "num_speculative_tokens": 2,
            "draft_tensor_parallel_size": draft_tp}  # fmt: skip
    with pytest.raises(ValueError, match="speculative_config.draft_tensor_parallel_size"):
        EngineConfig(speculative_config=spec, tensor_parallel_size=2)


needs_two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
)


@pytest.mark.gpu
@needs_two_gpus
def test_tp2_draft_model_on_gpus_replays_graphs(tiny_models):
    spec = {"model": str(tiny_models["qwen2"]), "num_speculative_tokens": K}
    assert _check(tiny_models["qwen2"], spec, **GPU).acceptance_rate == 1.0


@pytest.mark.gpu
@needs_two_gpus
def test_tp2_mtp_on_gpus_keeps_greedy_output(mtp_model):
    _check(mtp_model, {"method": "mtp", "num_speculative_tokens": 2}, **GPU)


def test_tp2_cost_sweep_times_the_draft_model_on_rank_0(tiny_models, tmp_path):
    atom = Path(sys.executable).parent / "atom"
    out = tmp_path / "w7.json"
    spec = json.dumps({"model": str(tiny_models["llama"]), "num_speculative_tokens": 2})
    proc = subprocess.run(
        [str(atom), "bench", "latency", "--model", str(tiny_models["qwen2"]),
         "--dtype", "float32", "--input-len", "8", "--output-len", "8", "--iters", "1",
         "--num-gpu-blocks-override", "32", "--tensor-parallel-size", "2",
         "--speculative-config", spec, "--spec-cost-sweep", "--output-json", str(out)],
        capture_output=True, text=True, timeout=200,
    )  # fmt: skip
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    rows = json.loads(out.read_text())["spec_cost_sweep"]["rows"]
    assert [row["k"] for row in rows] == [0, 1, 2]
    assert all(row["draft_ms"] > 0 for row in rows[1:])

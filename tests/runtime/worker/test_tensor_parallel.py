"""Tensor parallelism on CPU: 2 ranks over gloo, rank 0 in this process, rank 1 a worker process.

The CPU tests pin: greedy tokens with TP=2 are the tokens of one rank (every small model kind: split KV heads,
replicated KV heads, QKV bias, QK-norm; also under chunked prefill); each rank reads and holds only
its shard of the weights; a killed worker makes the next step raise promptly, naming the rank;
shutdown leaves no child process behind and the process can start another TP engine. The GPU
test (two or more GPUs, NCCL, CUDA graphs) runs the same parity where such a machine is lent.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import safetensors
import torch
from safetensors import safe_open

from atom_runtime import LLM
from atom_runtime.models.config import ModelConfig
from atom_runtime.models.loader import build_model
from atom_runtime.system import distributed
from tests.hf_reference import atom_greedy, random_prompts

KINDS = ["llama", "llama3", "qwen2", "qwen3"]
MAX_TOKENS = 10

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_leftover_tp_workers")]


PROMPTS = random_prompts(0, [1, 5, 16, 17, 40, 97])


def _run(folder: Path, tp: int, prompts=PROMPTS, device="cpu", **kwargs) -> list[list[int]]:
    kwargs.setdefault("num_gpu_blocks_override", 256)
    llm = LLM(str(folder), dtype="float32", device=device, tensor_parallel_size=tp, **kwargs)
    try:
        return atom_greedy(llm, prompts, MAX_TOKENS)
    finally:
        llm.shutdown()


# -- greedy parity -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_tp2_greedy_tokens_equal_one_rank(tiny_models, kind):
    one = _run(tiny_models[kind], 1)
    assert _run(tiny_models[kind], 2) == one


@pytest.mark.parametrize("kind", ["llama3", "qwen2"])
def test_tp2_chunked_prefill_equals_one_rank(tiny_models, kind):
    # A 7-token budget cuts every prompt into chunks that share steps with decodes.
    kwargs = dict(max_num_batched_tokens=7, max_num_seqs=4)
    one = _run(tiny_models[kind], 1, **kwargs)
    assert _run(tiny_models[kind], 2, **kwargs) == one


def test_tp2_preemption_under_a_small_kv_pool_equals_one_rank(tiny_models):
    # 9 blocks of 16 tokens cannot hold all six sequences at once: some are preempted and
    # recomputed, on both ranks' caches alike.
    kwargs = dict(num_gpu_blocks_override=9, max_model_len=120)
    folder = tiny_models["llama"]
    one = _run(folder, 1, **kwargs)
    llm = LLM(str(folder), dtype="float32", device="cpu", tensor_parallel_size=2, **kwargs)
    try:
        assert atom_greedy(llm, PROMPTS, MAX_TOKENS) == one
        assert llm.engine.scheduler.num_preemptions > 0
    finally:
        llm.shutdown()


# -- sharded loading -----------------------------------------------------------------------------


def _checkpoint_shapes(folder: Path) -> dict[str, torch.Size]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {k: torch.Size(f.get_slice(k).get_shape()) for k in f.keys()}


def _recording_safe_open(reads: list):
    """safetensors.safe_open whose handles record the shape of every tensor actually read."""

    class Slice:
        def __init__(self, name, inner):
            self.name, self.inner = name, inner

        def get_shape(self):
            return self.inner.get_shape()

        def __getitem__(self, index):
            out = self.inner[index]
            reads.append((self.name, tuple(self.inner.get_shape()), tuple(out.shape)))
            return out

    class File:
        def __init__(self, inner):
            self.inner = inner

        def keys(self):
            return self.inner.keys()

        def get_slice(self, name):
            return Slice(name, self.inner.get_slice(name))

        def get_tensor(self, name):
            out = self.inner.get_tensor(name)
            reads.append((name, tuple(out.shape), tuple(out.shape)))
            return out

    @contextlib.contextmanager
    def recording(*args, **kwargs):
        with safe_open(*args, **kwargs) as f:
            yield File(f)

    return recording


@pytest.mark.parametrize("kind", ["llama", "llama3"])
def test_each_rank_reads_and_holds_only_its_shard(tiny_models, kind, monkeypatch):
    folder = tiny_models[kind]
    cfg = ModelConfig.from_file(folder)
    shapes = _checkpoint_shapes(folder)
    reads: list[tuple[str, tuple, tuple]] = []  # (name, full shape, shape read from the file)
    monkeypatch.setattr(safetensors, "safe_open", _recording_safe_open(reads))

    def load(rank: int, world: int):
        monkeypatch.setattr(distributed, "_rank", rank)
        monkeypatch.setattr(distributed, "_world_size", world)
        reads.clear()
        # The safetensors library's lazy reads (its handles are what is recorded); the streamed
        # reader's per-rank rows are tested in tests/runtime/models/test_weight_stream.py.
        model = build_model(folder, cfg, "safetensors", torch.float32, torch.device("cpu"))
        return model, list(reads)

    full_model, _ = load(0, 1)
    full_params = dict(full_model.named_parameters())
    full_bytes = sum(p.numel() * 4 for p in full_params.values())
    replicated_kv = cfg.num_key_value_heads < 2
    shards = []
    for rank in (0, 1):
        model, rank_reads = load(rank, 2)
        shards.append(dict(model.named_parameters()))
        whole = {name for name, full, got in rank_reads if full == got and len(full) == 2}
        # A 2-D checkpoint tensor is read whole only when the layout replicates it (one KV head
        # for two ranks); everything else comes off disk as this rank's rows or columns.
        allowed = {
            n for n in shapes if replicated_kv and n.endswith(("k_proj.weight", "v_proj.weight"))
        }
        assert whole == allowed
        read_bytes = sum(4 * torch.Size(got).numel() for _, _, got in rank_reads)
        held = sum(p.numel() * 4 for p in model.parameters())
        replicated = sum(4 * t.numel() for n, t in shapes.items() if len(t) == 1 or n in allowed)
        assert held <= full_bytes / 2 + replicated
        assert held > full_bytes / 2 - replicated
        assert read_bytes <= full_bytes / 2 + replicated
    # The two shards together are the full tensor: rank 0 the first half, rank 1 the second.
    down = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(torch.cat([s[down] for s in shards], dim=1), full_params[down])
    gate_up = "model.layers.1.mlp.gate_up_proj.weight"
    halves = [s[gate_up].chunk(2) for s in shards]  # each rank: [its gate rows; its up rows]
    gate = torch.cat([h[0] for h in halves])
    up = torch.cat([h[1] for h in halves])
    assert torch.equal(torch.cat([gate, up]), full_params[gate_up])
    embed = "model.embed_tokens.weight"
    assert torch.equal(torch.cat([s[embed] for s in shards]), full_params[embed])


def test_vocab_split_pads_the_last_rank_with_zero_rows(monkeypatch):
    from atom_runtime.layers.embedding import VocabParallelEmbedding

    full = torch.arange(11 * 3, dtype=torch.float32).view(11, 3)
    rows = []
    for rank in (0, 1):
        monkeypatch.setattr(distributed, "_rank", rank)
        monkeypatch.setattr(distributed, "_world_size", 2)
        emb = VocabParallelEmbedding(11, 3)
        emb.weight.weight_loader(emb.weight, full)
        rows.append(emb.weight.data)
    assert torch.equal(rows[0], full[:6])
    assert torch.equal(rows[1][:5], full[6:])
    assert torch.equal(rows[1][5], torch.zeros(3))


# -- worker lifecycle ----------------------------------------------------------------------------


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()


def test_workers_are_named_frozen_sharded_and_gone_after_shutdown(tiny_models):
    folder = tiny_models["qwen3"]
    one = LLM(str(folder), dtype="float32", device="cpu", num_gpu_blocks_override=64)
    one_bytes = sum(p.numel() * p.element_size() for p in one.engine.executor.model.parameters())
    one.shutdown()

    llm = LLM(
        str(folder),
        dtype="float32",
        device="cpu",
        num_gpu_blocks_override=64,
        tensor_parallel_size=2,
    )
    executor = llm.engine.executor
    (worker,) = executor.workers
    assert _cmdline(worker.pid) == "ATOM::DP0TP1"
    # Warm-up then the GC policy ran in the worker over the same RPC path, and returned.
    (policy,) = executor.worker_gc_policies
    assert policy["frozen"] is True and policy["frozen_objects"] > 10_000
    norms = sum(
        p.numel() * 4 for n, p in one.engine.executor.model.named_parameters() if "norm" in n
    )
    for held in executor.parameter_bytes():
        assert one_bytes / 2 <= held <= one_bytes / 2 + norms
    assert atom_greedy(llm, PROMPTS[:2], MAX_TOKENS)
    llm.shutdown()
    assert not worker.is_alive()
    assert not Path(f"/proc/{worker.pid}").exists()  # reaped, not a zombie
    assert worker not in multiprocessing.active_children()
    assert distributed.tp_size() == 1
    with pytest.raises(RuntimeError, match="shut down"):
        executor.execute(None)


def test_killed_worker_fails_the_next_step_promptly_naming_the_rank(tiny_models):
    llm = LLM(
        str(tiny_models["llama"]),
        dtype="float32",
        device="cpu",
        num_gpu_blocks_override=64,
        tensor_parallel_size=2,
    )
    try:
        assert atom_greedy(llm, PROMPTS[:2], MAX_TOKENS)
        (worker,) = llm.engine.executor.workers
        os.kill(worker.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+\) was killed by SIGKILL"):
            atom_greedy(llm, PROMPTS[:2], MAX_TOKENS)
        assert time.monotonic() - start < 5.0
        # The engine stays down with the same reason.
        with pytest.raises(RuntimeError, match="rank 1"):
            atom_greedy(llm, PROMPTS[:1], MAX_TOKENS)
    finally:
        llm.shutdown()
    assert worker not in multiprocessing.active_children()


def test_rank0_failing_mid_step_takes_the_engine_down(tiny_models, monkeypatch):
    llm = LLM(
        str(tiny_models["llama"]),
        dtype="float32",
        device="cpu",
        num_gpu_blocks_override=64,
        tensor_parallel_size=2,
    )
    try:
        runner = llm.engine.executor.runner

        def broken_forward(inputs):
            raise MemoryError("simulated")

        monkeypatch.setattr(runner, "forward", broken_forward)
        with pytest.raises(RuntimeError, match="rank 0 failed mid-step: MemoryError: simulated"):
            atom_greedy(llm, PROMPTS[:1], MAX_TOKENS)
        monkeypatch.undo()
        # The worker may be waiting in a collective rank 0 never joined: no second step.
        with pytest.raises(RuntimeError, match="rank 0 failed mid-step"):
            atom_greedy(llm, PROMPTS[:1], MAX_TOKENS)
    finally:
        llm.shutdown()


def test_worker_dying_during_startup_fails_the_start_naming_the_rank(tiny_models):
    others = set(multiprocessing.active_children())

    def kill_first_worker():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for child in set(multiprocessing.active_children()) - others:
                os.kill(child.pid, signal.SIGKILL)  # still importing: it has said nothing yet
                return
            time.sleep(0.01)

    killer = threading.Thread(target=kill_first_worker)
    killer.start()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+\) was killed by SIGKILL"):
        LLM(str(tiny_models["llama"]), dtype="float32", device="cpu", tensor_parallel_size=2)
    killer.join()
    assert time.monotonic() - start < 10.0
    assert distributed.tp_size() == 1


def test_rank0_config_error_is_raised_as_is_and_stops_the_worker(tiny_models):
    # 4 attention heads do not split over 3 ranks: the start-up check refuses it from the config
    # alone, naming the flag, before any worker starts (the autouse fixture checks none is left).
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 3 .* heads .* 4 is not divisible"):
        LLM(str(tiny_models["qwen2"]), dtype="float32", device="cpu", tensor_parallel_size=3)


# -- on GPUs (NCCL) ------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_tp2_on_two_gpus_equals_one_gpu(tiny_models, kind):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    one = _run(tiny_models[kind], 1, device="cuda")
    assert _run(tiny_models[kind], 2, device="cuda") == one  # CUDA graphs captured per rank

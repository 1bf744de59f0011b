"""Streamed safetensors loading (models/weight_stream.py): the same weights as the safetensors
library's, read by threads ahead of the copies, and under tensor parallelism only the rows a rank
takes."""

from __future__ import annotations

import pytest
import torch

from atom_runtime.models.loader import build_model
from atom_runtime.models.source import load_model_config
from atom_runtime.models.weight_stream import (
    WeightStream,
    checkpoint_files,
    plan_reads,
    read_header,
)
from atom_runtime.system import distributed, startup


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_streamed_weights_equal_the_safetensors_library_reads(tiny_models, kind):
    folder = tiny_models[kind]
    cfg = load_model_config(folder)
    cpu = torch.device("cpu")
    phases = startup.restart()
    streamed = _params(build_model(folder, cfg, "auto", torch.float32, cpu))
    assert phases.seconds["weights_read"] > 0 and "weights_on_device" in phases.seconds
    reference = _params(build_model(folder, cfg, "safetensors", torch.float32, cpu))
    assert streamed.keys() == reference.keys()
    for name, t in reference.items():
        assert torch.equal(streamed[name], t), name


@pytest.mark.parametrize(
    ("load_format", "package"),
    [("runai_streamer", "runai_model_streamer"), ("fastsafetensors", "fastsafetensors")],
)
def test_other_streamers_load_the_same_weights(tiny_models, load_format, package):
    """vLLM's load formats through their libraries: the same weights as the reference."""
    pytest.importorskip(package, reason=f"{package} not installed (pip install .[streamers])")
    folder = tiny_models["llama"]
    cfg = load_model_config(folder)
    cpu = torch.device("cpu")
    got = _params(build_model(folder, cfg, load_format, torch.float32, cpu))
    reference = _params(build_model(folder, cfg, "safetensors", torch.float32, cpu))
    for name, t in reference.items():
        assert torch.equal(got[name], t), name


def test_sharded_checkpoint_is_read_across_files_in_small_requests(
    tiny_models, tmp_path, monkeypatch
):
    """A checkpoint in several shards (an index), read in requests smaller than one tensor, by
    several threads at once: every byte arrives once, in place."""
    from safetensors.torch import load_file, save_file

    from atom_runtime.models import weight_stream

    src = tiny_models["llama"]
    tensors = {k: v for f in checkpoint_files(src) for k, v in load_file(f).items()}
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"a.safetensors": names[:half], "b.safetensors": names[half:]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(tmp_path / file))
    weight_map = {k: f for f, keys in shards.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(
        __import__("json").dumps({"weight_map": weight_map})
    )
    monkeypatch.setattr(weight_stream, "CHUNK_BYTES", 4096)  # many requests per tensor
    entries = [e for f in checkpoint_files(tmp_path) for e in read_header(f)]
    stream = WeightStream(entries, readers=4, max_ahead_bytes=64 << 10)
    got = {name: t.read().clone() for name, t in stream}
    assert got.keys() == tensors.keys()
    for name, t in tensors.items():
        assert torch.equal(got[name], t), name
    assert stream.read_bytes == stream.total_bytes() == sum(t.nbytes for t in tensors.values())


def test_a_tensor_parallel_rank_reads_only_the_rows_it_takes(tiny_models, monkeypatch):
    """Rank 1 of 2: the dry run on the meta device plans half the rows of each column-parallel
    weight (q/k/v, gate/up, the vocab halves), whole tensors for row-parallel ones and norms;
    the streamed rows are exactly the rank's slice of the checkpoint."""
    from atom_runtime.models.loader import _construct

    folder = tiny_models["llama"]
    cfg = load_model_config(folder)
    monkeypatch.setattr(distributed, "_world_size", 2)
    monkeypatch.setattr(distributed, "_rank", 1)
    entries = [e for f in checkpoint_files(folder) for e in read_header(f)]
    meta = _construct(cfg, torch.float32, torch.device("meta"))
    plan = plan_reads(entries, meta.load_weights)
    q = "model.layers.0.self_attn.q_proj.weight"
    rows_q = cfg.num_attention_heads * cfg.head_dim
    assert plan.rows[q] == [(rows_q // 2, rows_q)]
    assert plan.rows["model.layers.0.self_attn.o_proj.weight"] is None  # columns: read whole
    assert plan.rows["model.norm.weight"] is None
    stream = WeightStream(entries, plan)
    full = sum(e.end - e.begin for e in entries)
    assert stream.total_bytes() < full * 0.75
    from safetensors import safe_open

    with safe_open(str(checkpoint_files(folder)[0]), framework="pt") as f:
        for name, t in stream:
            if name == q:
                mine = t.narrow(0, rows_q // 2, rows_q // 2)
                assert torch.equal(mine, f.get_tensor(q)[rows_q // 2 :])
                with pytest.raises(RuntimeError, match="only some rows were read"):
                    t.read()

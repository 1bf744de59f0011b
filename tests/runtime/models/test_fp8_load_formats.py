"""FP8 checkpoints through every safetensors load format (models/loader.py): the streamed reader
(`auto`), the safetensors library's lazy reads, Run:ai's streamer and fastsafetensors all hand
the FP8 layers the same FP8 bytes and fp32 scales (FP8 kept in memory: `runs_natively`
forced), and under tensor parallelism the streamed reader's read plan takes each rank's rows of
the FP8 weights and of their scales instead of falling back to whole tensors. An FP8 tensor
never becomes the run dtype by a plain cast: without a quantization_config the load fails
naming it."""

from __future__ import annotations

import json

import pytest
import torch

from atom_runtime.layers import fp8_linear
from atom_runtime.models.loader import _rank_read_plan, build_model
from atom_runtime.models.quant_config import resolve_quantization
from atom_runtime.models.source import load_model_config
from atom_runtime.models.weight_stream import WeightStream, checkpoint_files, read_header
from atom_runtime.system import distributed
from tests.fp8_checkpoints import write_fp8_checkpoint

FORMATS = ["auto", "safetensors", "runai_streamer", "fastsafetensors"]


def _fp8_state(folder, load_format: str) -> dict[str, torch.Tensor]:
    model = build_model(folder, load_model_config(folder), load_format, torch.float32,
                        torch.device("cpu"))  # fmt: skip
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("layout", ["block", "channel", "tensor"])
def test_every_load_format_gives_the_same_fp8_weights_and_scales(
    tiny_models, tmp_path, monkeypatch, layout
):
    monkeypatch.setattr(fp8_linear, "runs_natively", lambda device: True)
    folder, _ = write_fp8_checkpoint(tiny_models["llama"], tmp_path, layout, block=16)
    states = {fmt: _fp8_state(folder, fmt) for fmt in FORMATS}
    want = states["auto"]
    qkv = "model.layers.0.self_attn.qkv_proj"
    assert want[f"{qkv}.weight"].dtype == torch.float8_e4m3fn
    assert want[f"{qkv}.weight_scale"].dtype == torch.float32
    assert (f"{qkv}.input_scale" in want) == (layout == "tensor")
    for fmt, got in states.items():
        assert got.keys() == want.keys(), fmt
        for name, t in want.items():
            # FP8 bytes compared as bytes (FP8 has no equality kernel on CPU everywhere).
            a, b = (x.view(torch.uint8) if x.element_size() == 1 else x for x in (got[name], t))
            assert torch.equal(a, b), (fmt, name)


@pytest.mark.parametrize("load_format", ["auto", "safetensors"])
def test_fp8_tensors_without_a_quantization_config_are_refused_by_name(
    tiny_models, tmp_path, load_format
):
    folder, _ = write_fp8_checkpoint(tiny_models["llama"], tmp_path, "channel")
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError,
        match="model.layers.0.mlp.down_proj.weight.* is FP8.*quantization_config missing",
    ):
        build_model(folder, load_model_config(folder), load_format, torch.float32,
                    torch.device("cpu"))  # fmt: skip


@pytest.mark.parametrize("layout", ["block", "channel", "tensor"])
def test_a_tensor_parallel_rank_reads_its_rows_of_fp8_weights_and_scales(
    tiny_models, tmp_path, monkeypatch, layout
):
    """Rank 1 of 2: the dry run routes the checkpoint through the FP8 layers as the real load
    does, so q/k/v (column-parallel) are read by their rank's rows, block scales by their rank's
    block rows and per-channel scales by rows; the row-parallel o_proj is read whole."""
    folder, _ = write_fp8_checkpoint(tiny_models["llama"], tmp_path, layout, block=16)
    cfg = load_model_config(folder)
    qcfg = resolve_quantization(cfg.quantization_config, None, cfg.model_type)
    monkeypatch.setattr(distributed, "_world_size", 2)
    monkeypatch.setattr(distributed, "_rank", 1)
    entries = [e for f in checkpoint_files(folder) for e in read_header(f)]
    plan = _rank_read_plan(cfg, entries, qcfg)
    assert plan is not None, "the dry run failed: every tensor would be read whole"
    rows_q = cfg.num_attention_heads * cfg.head_dim
    attn = "model.layers.0.self_attn"
    assert plan.rows[f"{attn}.q_proj.weight"] == [(rows_q // 2, rows_q)]
    assert plan.rows[f"{attn}.o_proj.weight"] is None
    scale = f"{attn}.q_proj.weight_scale" + ("_inv" if layout == "block" else "")
    expected_scale_rows = {
        "block": [(rows_q // 32, rows_q // 16)],
        "channel": [(rows_q // 2, rows_q)],
        "tensor": None,  # one value, read whole
    }
    assert plan.rows[scale] == expected_scale_rows[layout]
    full = sum(e.end - e.begin for e in entries)
    assert WeightStream(entries, plan).total_bytes() < full * 0.8

"""The quantization config: what FP8 checkpoints and `--quantization fp8` mean, every other
quantization refused naming its field and value, ignore lists matched as vLLM and
compressed-tensors match them, and FP8 scales placed into fused, split layers part by part."""

from __future__ import annotations

import pytest
import torch

from atom_kernels.fp8_formats import dequantize_fp8, quantize_weight_block
from atom_runtime.config import EngineConfig
from atom_runtime.layers import fp8_linear
from atom_runtime.layers.fp8_scheme import Fp8Scheme
from atom_runtime.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from atom_runtime.models.quant_config import resolve_quantization
from tests.fp8_checkpoints import quantization_config


def _ct(**group) -> dict:
    cfg = quantization_config("channel", 128)
    cfg["config_groups"]["group_0"].update(group)
    return cfg


def test_the_three_checkpoint_layouts_and_the_flag():
    block = resolve_quantization(quantization_config("block", 128), None)
    assert (block.method, block.groups[0].scheme) == ("fp8", Fp8Scheme("block", (128, 128)))
    channel = resolve_quantization(quantization_config("channel", 128), None)
    assert channel.groups[0].scheme == Fp8Scheme("channel")
    assert channel.ignore == ("lm_head",)
    tensor = resolve_quantization(quantization_config("tensor", 128), None)
    assert tensor.groups[0].scheme == Fp8Scheme("tensor", static_input=True)
    online = resolve_quantization(None, "fp8")
    assert online.online and online.groups[0].scheme == Fp8Scheme("channel")
    assert resolve_quantization(None, None) is None
    static = resolve_quantization({"quant_method": "fp8", "activation_scheme": "static"}, None)
    assert static.groups[0].scheme == Fp8Scheme("tensor", static_input=True)
    # An FP8 checkpoint with the flag too: the checkpoint's own format wins.
    assert resolve_quantization(quantization_config("block", 128), "fp8") == block


@pytest.mark.parametrize(
    "cfg, field",
    [
        ({"quant_method": "awq", "bits": 4}, "quant_method: 'awq'"),
        ({"quant_method": "gptq"}, "quant_method: 'gptq'"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt: 'e5m2'"),
        ({"quant_method": "fp8", "activation_scheme": "weird"}, "activation_scheme: 'weird'"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size: [128]"),
        (
            {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
            "activation_scheme: 'static' with weight_block_size",
        ),
        ({**_ct(), "format": "pack-quantized"}, "format: 'pack-quantized'"),
        ({**_ct(), "sparsity_config": {"format": "sparse-24"}}, "sparsity_config"),
        (
            _ct(weights={"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}),
            "weights.type: 'int'",
        ),
        (_ct(input_activations=None), "input_activations: null"),
        (
            _ct(output_activations={"num_bits": 8, "type": "float", "strategy": "tensor"}),
            "output_activations",
        ),
        (
            _ct(input_activations={"num_bits": 8, "type": "float", "strategy": "token"}),
            "static token quantization",
        ),
        (
            {**_ct(), "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "channel"}},
            "kv_cache_scheme.strategy: 'channel'",
        ),
    ],
)
def test_what_the_engine_cannot_run_is_refused_naming_the_field(cfg, field):
    with pytest.raises(ValueError) as err:
        resolve_quantization(cfg, None)
    assert "quantization_config." in str(err.value) and field in str(err.value)
    assert "\n" not in str(err.value)


def test_flags_are_checked():
    with pytest.raises(ValueError, match="quantization: must be fp8"):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype: must be one of auto, fp8, fp8_e4m3"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")
    assert EngineConfig(quantization="fp8", kv_cache_dtype="fp8_e4m3").kv_cache_dtype == "fp8_e4m3"


def test_ignore_lists_match_as_vllm_and_compressed_tensors_do():
    layer = LinearBase(8, 8, bias=False)
    fp8 = resolve_quantization(
        {
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": ["model.layers.0.mlp", "re:.*self_attn\\.o_proj$"],
            "ignored_layers": ["model.layers.1.self_attn.q_proj"],
        },
        None,
    )
    assert (
        fp8.scheme_for("model.layers.0.mlp.down_proj", layer, ["model.layers.0.mlp.down_proj"])
        is None
    )
    assert (
        fp8.scheme_for(
            "model.layers.3.self_attn.o_proj", layer, ["model.layers.3.self_attn.o_proj"]
        )
        is None
    )
    assert fp8.scheme_for("model.layers.10.mlp.down_proj", layer, ["model.layers.10.mlp.down_proj"])
    # A fused layer whose parts the config treats differently cannot be one matrix.
    parts = [f"model.layers.1.self_attn.{p}_proj" for p in "qkv"]
    with pytest.raises(ValueError, match="quantized differently"):
        fp8.scheme_for("model.layers.1.self_attn.qkv_proj", layer, parts)
    ct = resolve_quantization({**_ct(), "ignore": ["lm_head", "re:.*mlp.gate$"]}, None)
    assert ct.scheme_for("model.layers.0.mlp.gate", layer, ["model.layers.0.mlp.gate"]) is None
    assert ct.scheme_for("model.layers.0.mlp.up_proj", layer, ["model.layers.0.mlp.up_proj"])
    # Targets match class names as compressed-tensors does ("Linear" is any LinearBase) ...
    named = resolve_quantization(_ct(targets=["re:.*down_proj$"]), None)
    assert (
        named.scheme_for("model.layers.0.mlp.up_proj", layer, ["model.layers.0.mlp.up_proj"])
        is None
    )
    # ... and the multimodal checkpoints' spelling of the text model is understood.
    mm = resolve_quantization(
        {**_ct(), "ignore": ["model.language_model.layers.0.mlp.up_proj"]}, None
    )
    assert (
        mm.scheme_for("model.layers.0.mlp.up_proj", layer, ["model.layers.0.mlp.up_proj"]) is None
    )


def test_per_tensor_parts_keep_their_scales_per_row_and_the_largest_input_scale():
    qkv = QKVParallelLinear(hidden_size=32, head_dim=8, num_heads=4, num_kv_heads=2, bias=False)
    fp8_linear.make_fp8(qkv, Fp8Scheme("tensor", static_input=True), torch.float8_e4m3fn)
    for part, value, inp in (("q", 0.5, 0.1), ("k", 0.25, 0.3), ("v", 0.125, 0.2)):
        qkv.weight_scale.weight_loader(qkv.weight_scale, torch.tensor([value]), part)
        qkv.input_scale.weight_loader(qkv.input_scale, torch.tensor([inp]), part)
    assert qkv.weight_scale.tolist() == [0.5] * 32 + [0.25] * 16 + [0.125] * 16
    assert qkv.input_scale.item() == pytest.approx(0.3)
    fp8_linear.finish_fp8(qkv, torch.float8_e4m3fn, native=True, dtype=torch.float32)
    assert qkv.weight_scale.shape == (64,)  # three values: stays per row
    down = RowParallelLinear(16, 8)
    fp8_linear.make_fp8(down, Fp8Scheme("tensor"), torch.float8_e4m3fn)
    down.weight_scale.weight_loader(down.weight_scale, torch.tensor(0.75))
    fp8_linear.finish_fp8(down, torch.float8_e4m3fn, native=True, dtype=torch.float32)
    assert down.weight_scale.tolist() == [0.75]  # one value: per tensor again


def test_block_scales_of_fused_parts_land_on_their_blocks():
    gate_up = MergedColumnParallelLinear(64, [32, 32])
    fp8_linear.make_fp8(gate_up, Fp8Scheme("block", (16, 16)), torch.float8_e4m3fn)
    assert fp8_linear.block_fits(gate_up, (16, 16)) and not fp8_linear.block_fits(gate_up, (64, 64))
    full = torch.randn(64, 64)
    for part in (0, 1):
        q, s = quantize_weight_block(full[32 * part : 32 * part + 32], (16, 16))
        gate_up.weight_loader(gate_up.weight, q, part)
        gate_up.weight_scale.weight_loader(gate_up.weight_scale, s, part)
    want = torch.cat(
        [
            dequantize_fp8(*quantize_weight_block(full[i : i + 32], (16, 16)), (16, 16))
            for i in (0, 32)
        ]
    )
    assert torch.equal(fp8_linear.dense_weight(gate_up), want)
    with pytest.raises(ValueError, match="FP8 weight loads only into an FP8 layer"):
        gate_up.weight_loader(gate_up.weight, full[:32], 0)


# -- at start-up: one line, exit 2, before any process starts or weight is read ---------------


def _serve_error(model, *flags: str) -> str:
    import subprocess

    from atom_runtime.bench.processes import ATOM

    proc = subprocess.run([str(ATOM), "serve", "--model", str(model), *flags],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("atom serve: error: ") and "Traceback" not in proc.stderr
    return line


def test_a_bad_quantization_config_ends_atom_serve_in_one_line_naming_the_field(
    tiny_models, tiny_mla_models, tmp_path
):
    import json
    import shutil

    cases = {
        "block": ({"quant_method": "fp8", "weight_block_size": [128, "x"]},
                  "quantization_config.weight_block_size: [128, 'x']"),
        "awq": ({"quant_method": "awq", "bits": 4}, "quantization_config.quant_method: 'awq'"),
        "ct": ({**_ct(), "format": "pack-quantized"}, "quantization_config.format: 'pack-quantized'"),
    }  # fmt: skip
    for name, (qcfg, field) in cases.items():
        folder = tmp_path / name
        shutil.copytree(tiny_models["llama"], folder)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "quantization_config": qcfg}))
        assert field in _serve_error(folder)
    line = _serve_error(tiny_mla_models["deepseek_v3"], "--kv-cache-dtype", "fp8")
    assert "kv_cache_dtype: 'fp8' is not supported for deepseek_v3" in line


def test_the_start_up_check_is_torch_free_and_refuses_what_loading_refuses():
    """check_quantization runs in the API server before the engine starts (no torch there);
    compressed-tensors' config groups are left to the engine's load (its types import torch)."""
    import subprocess
    import sys

    code = ("import sys; from atom_runtime.models.preflight import check_model; "
            "from atom_runtime.models.quant_config import check_quantization; "
            "check_quantization({'quant_method': 'fp8', 'weight_block_size': [128, 128]}, None); "
            "assert 'torch' not in sys.modules, 'torch imported'")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    from atom_runtime.models.quant_config import check_quantization

    with pytest.raises(ValueError, match="quantization: 'int8' is not supported"):
        check_quantization(quantization_config("channel", 128), "int8")
    with pytest.raises(ValueError, match="sparsity_config"):
        check_quantization({**_ct(), "sparsity_config": {"format": "sparse-24"}}, None)
    check_quantization(_ct(weights=None), None)  # a config group: the engine's load refuses it
    with pytest.raises(ValueError, match="weights: null"):
        resolve_quantization(_ct(weights=None), None)

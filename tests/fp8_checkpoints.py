"""FP8 checkpoints made from the tiny random models (tests/model_factory.py), in the layouts real
ones use, each with its dequantized twin for transformers, and the teacher-forced comparison
the FP8 accuracy tests share.

- "block": `quant_method: fp8` with `weight_block_size` (DeepSeek-V3 / Qwen3-*-FP8): FP8 weights
  and `weight_scale_inv` per block;
- "channel": compressed-tensors `float-quantized` (llm-compressor's FP8-dynamic): FP8 weights,
  `weight_scale` [N, 1], activations dynamic per token;
- "tensor": compressed-tensors per-tensor weights with static per-tensor `input_scale`.

The twin holds the same weights dequantized (fp32), so transformers computes with exactly the
values the engine's FP8 weights mean; what remains between them is what FP8 adds at run time
(activation quantization in W8A8 GEMMs, an FP8 KV cache) and accumulation order.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from atom_kernels.fp8_formats import (
    dequantize_fp8,
    quantize_weight_block,
    quantize_weight_per_channel,
    quantize_weight_per_tensor,
)
from atom_runtime import LLM, SamplingParams
from tests.hf_reference import hf_logprobs


def quantized_name(name: str) -> bool:
    """The checkpoint tensors real FP8 checkpoints store in FP8: the projections' weights (the
    routers, norms, embeddings and LM head stay in half precision)."""
    return name.endswith("_proj.weight") and ".mlp.gate." not in name


def _copy_side_files(src: Path, dst: Path) -> None:
    for f in src.iterdir():
        if f.suffix in (".json", ".jinja", ".txt") and f.name != "config.json":
            shutil.copy(f, dst / f.name)


def quantization_config(layout: str, block: int) -> dict:
    if layout == "block":
        return {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": [block, block],
        }
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
               "strategy": layout}  # fmt: skip
    inputs = {"num_bits": 8, "type": "float", "symmetric": True,
              "dynamic": layout == "channel", "strategy": "token" if layout == "channel" else "tensor"}  # fmt: skip
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs}
        },
        "ignore": ["lm_head"],
    }


def write_fp8_checkpoint(
    src: Path, dst: Path, layout: str, block: int = 32, input_scale: float = 0.02
) -> tuple[Path, Path]:
    """(the FP8 checkpoint, its dequantized fp32 twin) of the model in `src`, in `layout`."""
    fp8_dir, ref_dir = dst / f"fp8_{layout}", dst / f"ref_{layout}"
    fp8_dir.mkdir(parents=True, exist_ok=True)
    ref_dir.mkdir(parents=True, exist_ok=True)
    for file in sorted(src.glob("*.safetensors")):  # the model, and an MTP head's own file
        fp8, ref = _quantize_file(load_file(str(file)), layout, block, input_scale)
        save_file(fp8, str(fp8_dir / file.name))
        save_file(ref, str(ref_dir / file.name))
    config = json.loads((src / "config.json").read_text())
    (ref_dir / "config.json").write_text(json.dumps(config))
    config["quantization_config"] = quantization_config(layout, block)
    (fp8_dir / "config.json").write_text(json.dumps(config))
    for d in (fp8_dir, ref_dir):
        _copy_side_files(src, d)
    return fp8_dir, ref_dir


def _quantize_file(tensors: dict, layout: str, block: int, input_scale: float) -> tuple[dict, dict]:
    fp8, ref = {}, {}
    for name, w in tensors.items():
        if not quantized_name(name):
            fp8[name] = ref[name] = w
            continue
        stem = name.removesuffix(".weight")
        if layout == "block":
            q, s = quantize_weight_block(w, (block, block))
            fp8[f"{stem}.weight_scale_inv"] = s
            ref[name] = dequantize_fp8(q, s, (block, block))
        elif layout == "channel":
            q, s = quantize_weight_per_channel(w)
            fp8[f"{stem}.weight_scale"] = s[:, None].contiguous()
            ref[name] = dequantize_fp8(q, s)
        else:
            q, s = quantize_weight_per_tensor(w)
            fp8[f"{stem}.weight_scale"] = s
            fp8[f"{stem}.input_scale"] = torch.tensor([input_scale])
            ref[name] = dequantize_fp8(q, s)
        fp8[name] = q
    return fp8, ref


def write_online_twin(src: Path, dst: Path) -> Path:
    """What `--quantization fp8` makes of `src`, dequantized: every projection per output row
    (fp32), for transformers."""
    dst.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(src / "model.safetensors"))
    out = {}
    for name, w in tensors.items():
        if quantized_name(name) and ".experts." not in name:
            q, s = quantize_weight_per_channel(w)
            w = dequantize_fp8(q, s)
        out[name] = w
    save_file(out, str(dst / "model.safetensors"))
    shutil.copy(src / "config.json", dst / "config.json")
    _copy_side_files(src, dst)
    return dst


# A position is a clear call when transformers' best token leads its second by this many nats:
# far more than the FP8 error of a tiny model's log-probability (~0.03 mean, ~0.15 at most).
CLEAR_MARGIN = 0.3


def teacher_forced(llm: LLM, ref: Path, prompts: list[list[int]], max_tokens: int) -> dict:
    """Top-1 agreement and log-probability error of the engine against transformers on `ref`,
    teacher-forced: the engine generates greedily (its decode path) and reports each prompt
    position's log-probabilities (its prefill path); transformers scores the engine's own
    sequences, so every position is compared after the same prefix and one flipped near-tie
    does not change what the later positions see. Returns {"agreement", "max_err", "mean_err",
    "positions"} over every predicted position, and "clear_agreement" over the positions whose
    top-1 leads by CLEAR_MARGIN in transformers (the calls FP8 noise must not flip)."""
    params = SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1, prompt_logprobs=1
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    sequences = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs, strict=True)]
    reference = hf_logprobs(ref, sequences)
    agree = total = clear = clear_agree = 0
    errors = []
    for out, ref_lp in zip(outs, reference, strict=True):
        # Position i predicts token i + 1: prompt positions from prompt_logprobs, then decodes.
        steps = list(out.prompt_logprobs[1:]) + list(out.outputs[0].logprobs)
        for i, lp in enumerate(steps):
            top = max(lp, key=lp.get)
            best2 = ref_lp[i].topk(2).values
            same = int(top == int(ref_lp[i].argmax()))
            agree += same
            if float(best2[0] - best2[1]) > CLEAR_MARGIN:
                clear += 1
                clear_agree += same
            errors.append(abs(lp[top] - float(ref_lp[i][top])))
            total += 1
    return {
        "agreement": agree / total,
        "clear_agreement": clear_agree / max(clear, 1),
        "clear_positions": clear,
        "max_err": max(errors),
        "mean_err": sum(errors) / len(errors),
        "positions": total,
    }

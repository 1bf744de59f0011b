"""Loading a model under a `QuantConfig` (models/quant_config.py): which linear layers become
FP8, the checkpoint stream those layers read, and what happens once everything is loaded.

1. `prepare_fp8_layers` (model built, nothing loaded): every `LinearBase` the config quantizes
   turns FP8 now when the checkpoint holds it in FP8 (`fp8_linear.make_fp8`), or is marked to
   be quantized after loading (`--quantization fp8`, and dummy weights of any FP8 config).
   Layers whose checkpoint parts do not sit on whole scale blocks, or whose loader reorders
   rows, stay in the run dtype.
2. `Fp8CheckpointStream` wraps the (name, tensor) stream: FP8 weights and their scales pass
   through to FP8 layers as they are (scales as `weight_scale`, in fp32); an FP8 tensor bound
   anywhere else (MoE experts, which have no FP8 kernel yet; layers kept in the run dtype) is
   paired with its scale and dequantized; k/v cache scales are kept on the attention layers;
   every other tensor is converted to the run dtype.
3. `finish_fp8_layers`: quantize what was marked, convert to the platform's FP8 format, and
   where FP8 GEMMs do not run (CPU) dequantize again, each with one notice line.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from atom_kernels.fp8_formats import dequantize_fp8, fp8_dtype_for_platform, is_fp8
from atom_runtime.layers import fp8_linear
from atom_runtime.layers.linear import LinearBase
from atom_runtime.models.quant_config import QuantConfig

log = logging.getLogger(__name__)

# Checkpoint scale names: block checkpoints' `weight_scale_inv`, compressed-tensors'
# `weight_scale` (both dequantization multipliers), a static activation's `input_scale`.
_WEIGHT_SCALE = re.compile(r"(.+)\.weight_scale(?:_inv)?$")
_INPUT_SCALE = re.compile(r"(.+)\.input_scale$")
# k/v cache scales as vLLM and llm-compressor write them: `self_attn.k_scale` (or under
# `attn.`), one `kv_scale` for both, or the k/v projections' `output_scale`.
_KV_SCALE = re.compile(
    r"(.+\.self_attn)\.(?:attn\.)?(k_scale|v_scale|kv_scale)$|(.+\.self_attn)\.([kv])_proj\.output_scale$"
)


def fused_parts(model: nn.Module) -> dict[str, list[str]]:
    """Fused layer name -> the checkpoint projections it is built from (`stacked_params`
    inverted: "qkv_proj" -> ["q_proj", "k_proj", "v_proj"])."""
    parts: dict[str, list[str]] = {}
    for fragment, (fused, _) in getattr(model, "stacked_params", {}).items():
        parts.setdefault(fused, []).append(fragment)
    return parts


def prepare_fp8_layers(model: nn.Module, qcfg: QuantConfig, dummy: bool) -> dict[str, list]:
    """Step 1 (module docstring). Returns {"fp8": names made FP8 now, "later": names quantized
    after loading, "kept": names the config quantizes but which stay in the run dtype}."""
    fused = fused_parts(model)
    out: dict[str, list] = {"fp8": [], "later": [], "kept": []}
    for name, layer in model.named_modules():
        if not isinstance(layer, LinearBase) or not layer.quantizable:
            continue
        if getattr(layer.weight, "keep_fp32", False):  # a router computed in fp32
            continue
        stem, _, last = name.rpartition(".")
        parts = [f"{stem}.{p}" for p in fused.get(last, [])] or [name]
        scheme = qcfg.scheme_for(name, layer, parts)
        if scheme is None:
            continue
        if qcfg.online or dummy:
            layer.fp8_pending = scheme
            out["later"].append(name)
        elif not layer.loads_fp8_checkpoint or (
            scheme.block_size is not None and not fp8_linear.block_fits(layer, scheme.block_size)
        ):
            out["kept"].append(name)  # its FP8 tensors are dequantized as they load
        else:
            fp8_linear.make_fp8(layer, scheme, torch.float8_e4m3fn)  # checkpoints' format
            out["fp8"].append(name)
    return out


class Fp8CheckpointStream:
    """Step 2 (module docstring): iterate it in place of the checkpoint's (name, tensor) pairs.
    `dequantized` counts the FP8 tensors it turned into the run dtype, by kind."""

    def __init__(
        self, model: nn.Module, weights: Iterable, dtype: torch.dtype, qcfg: QuantConfig
    ) -> None:
        self.model = model
        self.weights = weights
        self.dtype = dtype
        # The block layout of the checkpoint's block scales (to dequantize experts with).
        self.block = next((g.scheme.block_size for g in qcfg.groups if g.scheme.block_size), None)
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.stacked = getattr(model, "stacked_params", {})
        self.dequantized: dict[str, int] = {"experts": 0, "other": 0}
        self._weights: dict[str, torch.Tensor] = {}  # FP8 weights waiting for their scale
        self._scales: dict[str, torch.Tensor] = {}  # scales waiting for their weight

    def __iter__(self) -> Iterator[tuple[str, object]]:
        skipped = getattr(self.model, "checkpoint_name", lambda name: name)  # (an MTP head)
        for name, tensor in self.weights:
            if skipped(name) is None:
                continue  # skipped by the model (rotary tables, MTP layers): not read at all
            kv = _KV_SCALE.match(name)
            if kv is not None:
                self._keep_kv_scale(kv, tensor)
                continue
            yield from self._route(name, tensor)
        leftover = sorted([*self._weights, *(f"{b}.weight_scale" for b in self._scales)])
        if leftover:
            raise ValueError(
                f"FP8 checkpoint tensors without their scale or weight: {leftover[:6]}"
            )

    def _route(self, name: str, tensor) -> Iterator[tuple[str, object]]:
        scale = _WEIGHT_SCALE.match(name)
        if scale is not None:
            base = scale.group(1)
            if self._fp8_target(base, "weight_scale"):
                yield f"{base}.weight_scale", tensor
            else:
                self._scales[base] = _read(tensor).float()
                yield from self._pair(base)
            return
        inp = _INPUT_SCALE.match(name)
        if inp is not None:
            if self._fp8_target(inp.group(1), "input_scale"):
                yield name, tensor
            return  # a dynamic layer here, or one kept in the run dtype: not needed
        if not _stored_fp8(tensor):
            yield name, tensor.to(self.dtype)
            return
        if not name.endswith(".weight"):
            raise ValueError(
                f"FP8 checkpoint tensor {name!r}: not a `.weight` with a `.weight_scale(_inv)` "
                "beside it, the FP8 layouts this engine reads"
            )
        base = name.removesuffix(".weight")
        if self._fp8_target(base, "weight_scale"):
            yield name, tensor
            return
        self._weights[base] = _read(tensor)
        yield from self._pair(base)

    def _pair(self, base: str) -> Iterator[tuple[str, torch.Tensor]]:
        """Once an FP8 weight and its scale are both here: the weight, dequantized."""
        if base not in self._weights or base not in self._scales:
            return
        weight, scale = self._weights.pop(base), self._scales.pop(base)
        self.dequantized["experts" if ".experts." in base else "other"] += 1
        yield f"{base}.weight", dequantize_any(weight, scale, self.block, self.dtype)

    def _fp8_target(self, base: str, param: str) -> bool:
        """Whether checkpoint tensor `base.<param>` loads into an FP8 layer's parameter."""
        target = base
        for fragment, (fused, _) in self.stacked.items():
            if f".{fragment}." in f"{base}.":
                target = f"{base}.".replace(f".{fragment}.", f".{fused}.")[:-1]
                break
        target = _text_model_name(target)
        return self.params.get(f"{target}.{param}") is not None

    def _keep_kv_scale(self, match: re.Match, tensor) -> None:
        prefix = match.group(1) or match.group(3)
        which = match.group(2) or f"{match.group(4)}_scale"
        read = _read(tensor)
        if read.is_meta:
            return  # the tensor-parallel read plan's dry run (models/loader.py): no values
        value = float(read.float().reshape(-1)[0])
        try:
            attn = self.model.get_submodule(f"{_text_model_name(prefix)}.attn")
        except AttributeError:
            return  # a layer this model does not have (an MTP layer)
        scales = getattr(attn, "checkpoint_kv_scales", None)
        if scales is None:
            return  # a cache without FP8 scales (MLA's latent cache)
        for key in ("k_scale", "v_scale") if which == "kv_scale" else (which,):
            scales[key] = value


def refuse_undeclared_fp8(weights: Iterable) -> Iterator[tuple[str, object]]:
    """The (name, tensor) stream of a checkpoint whose config declares no FP8 quantization,
    passed through; an FP8 tensor or an FP8 weight scale in it fails the load naming the missing
    quantization_config (whichever of a weight and its scale the file holds first: the weight
    loaders would otherwise say only that the scale "has no place in the model")."""
    for name, tensor in weights:
        if _stored_fp8(tensor) or _WEIGHT_SCALE.match(name):
            raise ValueError(
                f"checkpoint tensor {name!r} is FP8 (or an FP8 weight's scale) but config.json "
                "has no quantization_config saying how to read it (is the quantization_config "
                "missing? FP8 checkpoints declare quant_method fp8 or compressed-tensors)"
            )
        yield name, tensor


def checkpoint_loader(meta: nn.Module, qcfg: QuantConfig | None):
    """`load_weights` of a meta-device model as the real load runs it (the tensor-parallel read
    plan's dry run, models/weight_stream.py): for an FP8 checkpoint, with its FP8 layers and
    through the stream that routes weights and scales to them."""
    if qcfg is None or qcfg.online:
        return meta.load_weights
    prepare_fp8_layers(meta, qcfg, dummy=False)
    return lambda weights: meta.load_weights(
        Fp8CheckpointStream(meta, weights, torch.float32, qcfg)
    )


def mtp_head_stream(weights: Iterable, head: nn.Module, cfg, dtype: torch.dtype) -> Iterable:
    """The multi-token-prediction head's checkpoint stream (models/loader.py build_mtp_head):
    an FP8 checkpoint's head is dequantized at load (its layers are not made FP8: one draft
    layer is little of a step's bytes)."""
    from atom_runtime.models.quant_config import resolve_quantization

    qcfg = resolve_quantization(cfg.quantization_config, None, cfg.model_type)
    if qcfg is None:
        return refuse_undeclared_fp8(weights)
    # Only the head's tensors: the target's FP8 weights would be read and dequantized for
    # nothing (their scales do not pair with any of the head's parameters).
    mine = ((n, t) for n, t in weights if head.checkpoint_name(n) is not None)
    return Fp8CheckpointStream(head, mine, dtype, qcfg)


def _text_model_name(name: str) -> str:
    return re.sub(r"^model\.language_model\.", "model.", name)


def _read(t) -> torch.Tensor:
    return t if isinstance(t, torch.Tensor) else t.read()


def _stored_fp8(t) -> bool:
    """Whether a checkpoint tensor (a tensor, or a lazy one not read yet) is stored as FP8; an
    FP8 format other than e4m3 is refused by name."""
    stored = str(t.dtype if isinstance(t, torch.Tensor) else getattr(t, "stored_dtype", ""))
    if "e5m2" in stored.lower():
        raise ValueError(f"FP8 e5m2 checkpoint tensors are not supported (e4m3 only): {stored}")
    return is_fp8(t) if isinstance(t, torch.Tensor) else stored == "F8_E4M3"


def dequantize_any(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple | None, dtype: torch.dtype
) -> torch.Tensor:
    """An FP8 checkpoint tensor in `dtype`: 2-D with a per-tensor, per-row or block scale, or
    3-D (fused experts) with one such scale per leading index."""
    if weight.dim() == 3:
        if scale.dim() == 0 or scale.numel() == 1:
            scale = scale.reshape(1).expand(weight.shape[0]).reshape(-1, 1)
        return torch.stack(
            [dequantize_any(w, s, block, dtype) for w, s in zip(weight, scale, strict=True)]
        )
    n = weight.shape[0]
    is_block = block is not None and scale.dim() == 2 and tuple(scale.shape) != (n, 1)
    return dequantize_fp8(weight, scale, block if is_block else None, dtype)


def finish_fp8_layers(
    model: nn.Module,
    qcfg: QuantConfig,
    device: torch.device,
    dtype: torch.dtype,
    stream: Fp8CheckpointStream | None,
) -> dict[str, int]:
    """Step 3 (module docstring), with one notice line for each thing not run as FP8. Returns
    counts: "native" FP8 layers, "dequantized" ones."""
    fp8_dtype = fp8_dtype_for_platform(device)
    native = fp8_linear.runs_natively(device)
    counts = {"native": 0, "dequantized": 0}
    scheme = None
    for layer in model.modules():
        if not isinstance(layer, LinearBase):
            continue
        pending = getattr(layer, "fp8_pending", None)
        if pending is not None:
            fp8_linear.quantize_online(layer, pending, fp8_dtype)
            layer.fp8_pending = None
        if layer.weight_scale is not None:
            scheme = layer.fp8_scheme
            fp8_linear.finish_fp8(layer, fp8_dtype, native, dtype)
            counts["native" if native else "dequantized"] += 1
    _notices(model, qcfg, device, dtype, counts, stream, scheme)
    return counts


def _notices(model, qcfg, device, dtype, counts, stream, scheme) -> None:
    what = str(dtype).removeprefix("torch.")
    if counts["native"]:
        log.info("%d linear layers run in FP8 (%s, %s)", counts["native"], scheme.describe(),
                 "quantized at load" if qcfg.online else qcfg.method)  # fmt: skip
    if counts["dequantized"]:
        log.warning(
            "FP8 weights dequantized to %s at load: no FP8 GEMM on %s (%d layers; correct, at the "
            "speed and memory of %s)", what, device, counts["dequantized"], what,
        )  # fmt: skip
    experts = stream.dequantized["experts"] if stream is not None else 0
    if experts:
        log.warning(
            "%d FP8 MoE expert tensors dequantized to %s at load: there is no FP8 fused-MoE "
            "kernel yet", experts, what,
        )  # fmt: skip
    elif qcfg.online and any(hasattr(m, "w13") for m in model.modules()):
        log.warning("MoE experts stay in %s under --quantization fp8: no FP8 fused-MoE kernel yet",
                    what)  # fmt: skip
    others = stream.dequantized["other"] if stream is not None else 0
    if others:
        log.info(
            "%d FP8 tensors of layers kept in %s (ignored by the config, loaded with their rows "
            "reordered, or off the scale blocks) dequantized at load", others, what,
        )  # fmt: skip

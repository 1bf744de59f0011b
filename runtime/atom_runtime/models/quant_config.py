"""Which quantization a model runs with: a checkpoint's `quantization_config` (config.json) or
`--quantization fp8`, read into one `QuantConfig`; anything the engine cannot run is refused at
start-up with one line naming the field and its value.

Understood:
- `quant_method: "fp8"` (transformers' FineGrainedFP8 / DeepSeek-V3 / Qwen3-*-FP8 checkpoints):
  block-scaled weights with `weight_block_size` (scales `weight_scale_inv`, activations
  quantized per 128-column group at run time), or per-tensor weights (`weight_scale`) with
  `activation_scheme` "dynamic" (per token) or "static" (the checkpoint's `input_scale`).
  `ignored_layers` / `modules_to_not_convert` name layers kept in the run dtype.
- `quant_method: "compressed-tensors"` with `format: "float-quantized"` (llm-compressor's FP8
  checkpoints), read through compressed-tensors' own config types: 8-bit float weights per
  tensor, per channel or in blocks, activations dynamic per token (or per group for blocks) or
  static per tensor; `ignore` entries and group `targets` matched by compressed-tensors'
  `is_match` (exact names, `re:` regexes, class names such as `Linear`); a `kv_cache_scheme` of
  8-bit float per-tensor scales (the checkpoint's `k_scale` / `v_scale`).
- `--quantization fp8` on a half-precision checkpoint: every linear layer quantized at load,
  per output channel, activations dynamic per token (vLLM's online FP8).

A fused layer (qkv_proj, gate_up_proj) is matched through its checkpoint parts (q_proj, k_proj,
v_proj), which must all agree, as vLLM requires.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from atom_runtime.layers.fp8_scheme import Fp8Scheme

if TYPE_CHECKING:  # torch-free at import: the start-up check (check_quantization) runs early
    from torch import nn

log = logging.getLogger(__name__)

QUANTIZATION_CHOICES = ("fp8",)  # --quantization
ONLINE = "online"
_FP8_KEYS_IGNORED = ("ignored_layers", "modules_to_not_convert")
_CT_FORMATS = ("float-quantized",)
# --kv-cache-dtype fp8 for multi-head latent attention (refused at start-up and by the runner).
KV_DTYPE_REFUSED = (
    "kv_cache_dtype: {dtype!r} is not supported for {model} (the latent cache of multi-head "
    "latent attention has no FP8 kernels yet); use --kv-cache-dtype auto"
)


@dataclass(frozen=True)
class QuantGroup:
    """Layers matching `targets` (compressed-tensors' target strings; ("Linear",) for the other
    methods) run with `scheme`."""

    targets: tuple[str, ...]
    scheme: Fp8Scheme


@dataclass(frozen=True)
class QuantConfig:
    """method: "fp8", "compressed-tensors" (an FP8 checkpoint) or "online" (quantized at load)."""

    method: str
    groups: tuple[QuantGroup, ...]
    ignore: tuple[str, ...] = ()
    kv_scales: bool = False  # the checkpoint declares per-tensor k/v cache scales

    @property
    def online(self) -> bool:
        return self.method == ONLINE

    def scheme_for(self, name: str, module: nn.Module, parts: list[str]) -> Fp8Scheme | None:
        """The scheme of layer `name` of our model, whose checkpoint tensors are `parts` (its
        own name, or the names of the projections a fused layer is built from); None when it
        stays in the run dtype. Raises when the parts disagree."""
        found = {part: self._scheme_of(part, module) for part in parts}
        schemes = set(found.values())
        if len(schemes) > 1:
            said = ", ".join(
                f"{p}: {s.describe() if s else 'not quantized'}" for p, s in found.items()
            )
            raise ValueError(
                f"quantization_config: the parts of fused layer {name} are quantized differently "
                f"({said}); they are one matrix here"
            )
        return schemes.pop()

    def _scheme_of(self, name: str, module: nn.Module) -> Fp8Scheme | None:
        names = _checkpoint_spellings(name)
        if self.method == "compressed-tensors":
            from compressed_tensors.utils.match import is_match

            if self.ignore and any(is_match(n, module, self.ignore) for n in names):
                return None
            for group in self.groups:
                if any(is_match(n, module, group.targets) for n in names):
                    return group.scheme
            return None
        if any(_fp8_ignored(n, self.ignore) for n in names):
            return None
        return self.groups[0].scheme


def _checkpoint_spellings(name: str) -> list[str]:
    """The names a layer may go by in a checkpoint's ignore lists: ours, and the multimodal
    Qwen3.5 checkpoints' `model.language_model.` spelling of the text model."""
    names = [name]
    if name.startswith("model."):
        names.append("model.language_model." + name.removeprefix("model."))
    return names


def _fp8_ignored(name: str, ignore: tuple[str, ...]) -> bool:
    """`quant_method: fp8`'s ignore entries: an exact layer name (vLLM), a `re:` regex matched
    from the start (compressed-tensors' spelling), or a module above the layer (transformers'
    `modules_to_not_convert` names whole subtrees, e.g. `lm_head`, `model.layers.0.mlp`)."""
    for entry in ignore:
        if entry.startswith("re:"):
            if re.match(entry.removeprefix("re:"), name):
                return True
        elif name == entry or name.startswith(entry + "."):
            return True
    return False


def check_quantization(hf_quant: dict | None, flag: str | None, model_type: str = "") -> None:
    """The start-up check (models/preflight.py, before any process starts or weight is read):
    raises what `resolve_quantization` raises, torch-free. A compressed-tensors config gets its
    top-level fields checked here; its config groups need compressed-tensors' types, whose
    import (torch and transformers) would cost the API server seconds, and are checked when the
    engine loads the model."""
    if isinstance(hf_quant, dict) and hf_quant.get("quant_method") == "compressed-tensors":
        resolve_quantization(None, flag, model_type)  # the flag's value
        _ct_top_level(hf_quant)
        return
    resolve_quantization(hf_quant, flag, model_type)


def resolve_quantization(
    hf_quant: dict | None, flag: str | None, model_type: str = ""
) -> QuantConfig | None:
    """The quantization the engine runs with, from the checkpoint's `quantization_config` and
    `--quantization`; None for a plain half-precision model. Raises ValueError naming the field
    and value it cannot run. GPT-OSS's `mxfp4` is its family's own: its loader dequantizes the
    MXFP4 experts (models/mxfp4.py), and the rest is half precision like any checkpoint's."""
    if flag is not None and flag not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization: {flag!r} is not supported (choices: fp8)")
    if isinstance(hf_quant, dict) and hf_quant.get("quant_method") == "mxfp4":
        if model_type != "gpt_oss":
            raise ValueError(
                f"quantization_config.quant_method: 'mxfp4' is not supported for {model_type} "
                "(GPT-OSS's MXFP4 experts only)"
            )
        hf_quant = None
    if hf_quant is None:
        if flag is None:
            return None
        return QuantConfig(ONLINE, (QuantGroup(("Linear",), Fp8Scheme("channel")),))
    if not isinstance(hf_quant, dict):
        raise ValueError(f"quantization_config: expected an object, got {hf_quant!r}")
    method = hf_quant.get("quant_method")
    if method == "fp8":
        parsed = _fp8_method(hf_quant)
    elif method == "compressed-tensors":
        parsed = _compressed_tensors(hf_quant)
    else:
        raise ValueError(
            f"quantization_config.quant_method: {method!r} is not supported (this engine runs "
            "FP8 checkpoints: fp8, compressed-tensors float-quantized)"
        )
    if flag is not None:
        log.info(
            "--quantization %s: the checkpoint is already FP8 (%s); kept as it is", flag, method
        )
    return parsed


def _fp8_method(cfg: dict) -> QuantConfig:
    fmt = cfg.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config.fmt: {fmt!r} is not supported (e4m3 only)")
    act = cfg.get("activation_scheme", "dynamic")
    if act not in ("dynamic", "static"):
        raise ValueError(
            f"quantization_config.activation_scheme: {act!r} is not supported (dynamic, static)"
        )
    block = cfg.get("weight_block_size")
    if block is not None and (
        not isinstance(block, (list, tuple)) or len(block) != 2
        or not all(isinstance(b, int) and b > 0 for b in block)
    ):  # fmt: skip
        raise ValueError(
            f"quantization_config.weight_block_size: {block!r} is not two positive integers"
        )
    if block is not None and act == "static":
        raise ValueError(
            "quantization_config.activation_scheme: 'static' with weight_block_size is not "
            "supported (block-scaled weights take per-group dynamic activations)"
        )
    ignore: list[str] = []
    for key in _FP8_KEYS_IGNORED:
        value = cfg.get(key) or []
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"quantization_config.{key}: {value!r} is not a list of names")
        ignore += value
    scheme = (
        Fp8Scheme("block", tuple(block)) if block else Fp8Scheme("tensor", static_input=act == "static")
    )  # fmt: skip
    return QuantConfig("fp8", (QuantGroup(("Linear",), scheme),), tuple(ignore))


def _compressed_tensors(cfg: dict) -> QuantConfig:
    from compressed_tensors.quantization import QuantizationConfig
    from pydantic import ValidationError

    _ct_top_level(cfg)
    try:
        parsed = QuantizationConfig.model_validate(
            {k: v for k, v in cfg.items() if k not in ("sparsity_config", "transform_config")}
        )
    except ValidationError as e:
        first = e.errors()[0]  # its location without pydantic's validator names
        where = ".".join(str(p) for p in first["loc"] if "[" not in str(p))
        value = repr(first.get("input"))
        value = value if len(value) <= 120 else value[:117] + "..."
        message = first["msg"].removeprefix("Value error, ")
        raise ValueError(f"quantization_config.{where}: {value}: {message}") from None
    if parsed.format not in _CT_FORMATS:
        raise ValueError(
            f"quantization_config.format: {parsed.format!r} is not supported (float-quantized "
            "FP8 only; int4/int8/NVFP4/MXFP4 packings are not)"
        )
    groups = []
    for key, scheme in parsed.config_groups.items():
        if isinstance(scheme, list):  # a preset name list: not a scheme we can read
            raise ValueError(f"quantization_config.config_groups.{key}: {scheme!r} is not a scheme")
        groups.append(QuantGroup(tuple(scheme.targets), _ct_scheme(key, scheme)))
    if not groups:
        raise ValueError("quantization_config.config_groups: empty (nothing is quantized)")
    kv = parsed.kv_cache_scheme
    if kv is not None:
        _require(kv, "kv_cache_scheme", ("tensor",), dynamic=False)
    return QuantConfig(
        "compressed-tensors", tuple(groups), tuple(parsed.ignore or ()), kv is not None
    )


def _ct_top_level(cfg: dict) -> None:
    """The compressed-tensors fields refused without its types: sparsity and transforms, and a
    `format` other than float-quantized."""
    for key in ("sparsity_config", "transform_config"):
        if cfg.get(key):
            raise ValueError(f"quantization_config.{key}: {cfg[key]!r} is not supported")
    if "format" in cfg and cfg["format"] not in _CT_FORMATS:
        raise ValueError(
            f"quantization_config.format: {cfg['format']!r} is not supported (float-quantized "
            "FP8 only; int4/int8/NVFP4/MXFP4 packings are not)"
        )


def _ct_scheme(key: str, scheme) -> Fp8Scheme:
    where = f"config_groups.{key}"
    if getattr(scheme, "format", None) not in (None, *_CT_FORMATS):
        raise ValueError(f"quantization_config.{where}.format: {scheme.format!r} is not supported")
    if scheme.weights is None:
        raise ValueError(f"quantization_config.{where}.weights: null (nothing to quantize)")
    w = scheme.weights
    _require(w, f"{where}.weights", ("tensor", "channel", "block"), dynamic=False)
    if scheme.output_activations is not None:
        raise ValueError(
            f"quantization_config.{where}.output_activations: {scheme.output_activations!r} "
            "is not supported"
        )
    a = scheme.input_activations
    if a is None:
        raise ValueError(
            f"quantization_config.{where}.input_activations: null (weight-only FP8, W8A16) is "
            "not supported: the FP8 GEMMs here quantize their inputs too"
        )
    if w.strategy == "block":
        _require(a, f"{where}.input_activations", ("group",), dynamic=True)
        block = tuple(w.block_structure or ())
        if len(block) != 2 or a.group_size != block[1]:
            raise ValueError(
                f"quantization_config.{where}.input_activations.group_size: {a.group_size} "
                f"must equal the weight block's columns ({w.block_structure})"
            )
        return Fp8Scheme("block", block)
    _require(a, f"{where}.input_activations", ("token", "tensor"), dynamic=None)
    static = a.dynamic is False
    if static and a.strategy != "tensor":
        raise ValueError(
            f"quantization_config.{where}.input_activations.strategy: static {a.strategy!r} "
            "scales are not supported (static scales are per tensor)"
        )
    # Dynamic per-tensor activations run per token: finer, never less accurate.
    return Fp8Scheme(w.strategy, static_input=static)


def _require(args, where: str, strategies: tuple[str, ...], dynamic: bool | None) -> None:
    """Refuse quantization args the FP8 kernels cannot run, naming the field and value."""
    checks = (
        ("type", args.type, ("float",)),
        ("num_bits", args.num_bits, (8,)),
        ("symmetric", args.symmetric, (True,)),
        ("strategy", args.strategy, strategies),
    )
    for field, value, allowed in checks:
        if value not in allowed:
            raise ValueError(
                f"quantization_config.{where}.{field}: {value!r} is not supported "
                f"({', '.join(map(str, allowed))})"
            )
    if dynamic is not None and args.dynamic not in (dynamic,):
        raise ValueError(
            f"quantization_config.{where}.dynamic: {args.dynamic!r} is not supported ({dynamic})"
        )

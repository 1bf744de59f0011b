"""Loading weights: a Hugging Face folder (config.json + safetensors, possibly sharded), a GGUF
file (dequantized to the run dtype), or random weights from a config (`load_format="dummy"`),
with a progress bar and the weights_read / weights_on_device start-up phases (system/startup.py).

Safetensors, by load format (config.LOAD_FORMATS):
- auto: streamed (weight_stream.py): reader threads read ahead of the copies to the device; under
  tensor parallelism each rank reads only the rows it takes where they are contiguous;
- safetensors: the safetensors library, lazily (`CheckpointTensor`): each parameter's weight
  loader narrows a tensor to this rank's rows or columns and only that slice is read, one
  tensor after another in the loading thread (the reference);
- runai_streamer, fastsafetensors: those libraries (vLLM's names), whole tensors read by their
  own threads (fastsafetensors shard by shard onto the device).
GGUF tensors are dequantized whole (quantization blocks run along rows) and then narrowed.
Where a model comes from (paths, hub ids, the default model) is models/source.py.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from atom_kernels.fp8_formats import is_fp8
from atom_runtime.models.config import ModelConfig
from atom_runtime.models.gguf import gguf_field, open_gguf

# Where models come from is models/source.py (torch-free); these names stay importable from here.
from atom_runtime.models.source import (  # noqa: F401
    DEFAULT_MODEL,
    default_model_path,
    gguf_model_config,
    is_gguf,
    load_model_config,
    resolve_model_path,
)
from atom_runtime.models.weight_stream import (
    ReadPlan,
    StreamedTensor,
    WeightStream,
    checkpoint_files,
    plan_reads,
    read_header,
)
from atom_runtime.system import startup
from atom_runtime.system.distributed import tp_rank, tp_size

log = logging.getLogger(__name__)

# -- safetensors ---------------------------------------------------------------------------------


class CheckpointTensor:
    """One tensor of an open safetensors file, not read yet. A weight loader calls `narrow` to
    read only its rank's part; `read` reads it whole (replicated parameters). `to(dtype)` sets the
    dtype the reads convert to, as `Tensor.to` would."""

    def __init__(self, file, name: str, dtype: torch.dtype | None = None) -> None:
        self._file = file
        self.name = name
        self.dtype = dtype
        self._slice = file.get_slice(name)
        self.shape = torch.Size(self._slice.get_shape())

    def dim(self) -> int:
        return len(self.shape)

    @property
    def stored_dtype(self) -> str:
        """The dtype in the file, as safetensors names it ("BF16", "F8_E4M3", ...)."""
        return self._slice.get_dtype()

    def to(self, dtype: torch.dtype) -> CheckpointTensor:
        return CheckpointTensor(self._file, self.name, dtype)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if not 0 <= dim < self.dim():
            raise ValueError(f"{self.name}: dim {dim} out of range for shape {tuple(self.shape)}")
        if start < 0 or length < 0 or start + length > self.shape[dim]:
            raise ValueError(
                f"{self.name}: [{start}, {start + length}) is outside dim {dim} of "
                f"{tuple(self.shape)}"
            )
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self._convert(self._slice[index])

    def read(self) -> torch.Tensor:
        return self._convert(self._file.get_tensor(self.name))

    def _convert(self, t: torch.Tensor) -> torch.Tensor:
        # Integer and FP8 tensors (quantized blocks and their scales) keep their dtype: only a
        # loader that knows their scales knows what they mean (a cast would drop them).
        if self.dtype is None or not t.is_floating_point() or is_fp8(t):
            return t
        return t.to(self.dtype)


def iter_safetensors(folder: Path) -> Iterator[tuple[str, CheckpointTensor]]:
    """Every tensor of a (possibly sharded) safetensors checkpoint, one at a time, lazily: a
    tensor's file stays open until the next one is asked for."""
    from safetensors import safe_open

    for file in checkpoint_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                yield key, CheckpointTensor(f, key)


# -- GGUF ------------------------------------------------------------------------------------------

# GGUF tensor name -> Hugging Face name ({i} is the layer index).
_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}


def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of Q/K rows (its rotary pairs interleave; HF's rotate halves)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_gguf(path: Path, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a GGUF file, dequantized to fp32, under its Hugging Face name."""
    import gguf

    reader = open_gguf(path)
    arch = gguf_field(reader, "general.architecture")
    lookup = {}
    for pattern, hf in _GGUF_NAMES.items():
        if "{i}" in pattern:
            for i in range(cfg.num_hidden_layers):
                lookup[pattern.format(i=i)] = hf.format(i=i)
        else:
            lookup[pattern] = hf
    for tensor in reader.tensors:
        name = lookup.get(tensor.name)
        if name is None:
            if tensor.name.startswith("rope_freqs"):
                continue
            raise ValueError(f"GGUF tensor {tensor.name!r} is not understood")
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        data = np.asarray(data, dtype=np.float32).reshape(tuple(reversed(tensor.shape.tolist())))
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            n = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            data = _unpermute_rope(data, n)
        # A copy: unquantized tensors come back as read-only views of the memory-mapped file.
        yield name, torch.from_numpy(np.array(data, dtype=np.float32, order="C", copy=True))


# -- the model itself ------------------------------------------------------------------------------


def build_model(
    path: Path,
    cfg: ModelConfig,
    load_format: str,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    quantization: str | None = None,
):
    """The model on `device` in `dtype`, its weights loaded (or random for "dummy"); FP8 where
    the checkpoint's quantization_config or `quantization` ("fp8") says (models/fp8_loading.py).
    A progress bar on rank 0; the weights_read / weights_on_device start-up phases recorded."""
    from atom_runtime.models import fp8_loading
    from atom_runtime.models.quant_config import resolve_quantization

    qcfg = resolve_quantization(cfg.quantization_config, quantization, cfg.model_type)
    phases = startup.recorder()
    start = time.perf_counter()
    model = _construct(cfg, dtype, device)
    if qcfg is not None:
        fp8_loading.prepare_fp8_layers(model, qcfg, dummy=load_format == "dummy")
    stream = None
    if load_format == "dummy":
        _fill_dummy(model, seed)
        _synchronize(device)
        phases.add("weights_on_device", time.perf_counter() - start, "random weights")
    else:
        stream = _load_checkpoint(model, path, cfg, load_format, dtype, device, qcfg)
    if qcfg is not None:
        fp8_loading.finish_fp8_layers(model, qcfg, device, dtype, stream)
    return model.eval()


def _load_checkpoint(model, path: Path, cfg: ModelConfig, load_format: str, dtype, device, qcfg):
    """Load every checkpoint tensor into `model`; returns the FP8 stream it read through (None
    for a half-precision model)."""
    phases = startup.recorder()
    start = time.perf_counter()
    source = _weight_source(path, cfg, load_format, device, qcfg)
    stream = None
    with _progress(source.total_bytes, source.label) as bar:
        tensors = bar.follow(source.tensors)
        if qcfg is not None and not qcfg.online:
            from atom_runtime.models.fp8_loading import Fp8CheckpointStream

            stream = Fp8CheckpointStream(model, tensors, dtype, qcfg)
            loaded = model.load_weights(stream)
        else:
            from atom_runtime.models.fp8_loading import refuse_undeclared_fp8

            tensors = refuse_undeclared_fp8(tensors)
            loaded = model.load_weights((n, t.to(dtype)) for n, t in tensors)
    read_done = start + source.read_seconds() if source.read_seconds() else time.perf_counter()
    _synchronize(device)
    done = time.perf_counter()
    gb = source.total_bytes / 1e9
    read_s = read_done - start
    phases.add(
        "weights_read", read_s, f"{gb:.2f} GB, {gb / max(read_s, 1e-9):.2f} GB/s, {source.label}"
    )
    phases.add("weights_on_device", done - read_done, f"{device}")
    missing = {n for n, _ in model.named_parameters() if n not in loaded and not _is_tied(model, n)}
    if missing:
        raise ValueError(f"checkpoint is missing tensors: {sorted(missing)[:8]}")
    return stream


def _construct(cfg: ModelConfig, dtype: torch.dtype, device: torch.device):
    from atom_runtime.models.deepseek import DeepseekForCausalLM
    from atom_runtime.models.gpt_oss import GptOssForCausalLM
    from atom_runtime.models.llama import LlamaForCausalLM
    from atom_runtime.models.qwen3_next import Qwen3NextForCausalLM

    # Parameters are created in the run dtype (a 61B-parameter model built in fp32 first would
    # need twice its memory); tables that need fp32 ask for it (the rotary cos/sin cache).
    with torch.device(device), _default_dtype(dtype):
        if cfg.mla is not None:
            model = DeepseekForCausalLM(cfg)
        elif cfg.is_hybrid:
            model = Qwen3NextForCausalLM(cfg)
        elif cfg.model_type == "gpt_oss":
            model = GptOssForCausalLM(cfg)
        else:
            model = LlamaForCausalLM(cfg)
    _to_run_dtype(model, dtype)
    return model


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype if dtype.is_floating_point else saved)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class _Source:
    tensors: Iterator[tuple[str, object]]
    total_bytes: int
    label: str
    read_seconds: Callable[[], float] = lambda: 0.0


def _weight_source(path: Path, cfg: ModelConfig, load_format: str, device, qcfg) -> _Source:
    """Where the tensors come from for this load format (LOAD_FORMATS in config.py); `qcfg`
    (an FP8 checkpoint's QuantConfig, or None) shapes the tensor-parallel read plan."""
    if is_gguf(path):
        if load_format not in ("auto", "gguf"):
            raise ValueError(f"load_format: {load_format} cannot read a GGUF file ({path})")
        return _Source(iter_gguf(path, cfg), _gguf_bytes(path), "GGUF, dequantized")
    if load_format == "gguf":
        raise ValueError(f"load_format: gguf needs a .gguf file, got {path}")
    folder = path if path.is_dir() else path.parent
    if load_format == "safetensors":
        files = checkpoint_files(folder)
        total = sum(f.stat().st_size for f in files)
        return _Source(iter_safetensors(folder), total, "safetensors library, lazy reads")
    if load_format == "runai_streamer":
        return _runai_source(folder)
    if load_format == "fastsafetensors":
        return _fastsafetensors_source(folder, device)
    if load_format != "auto":
        raise ValueError(f"load_format: {load_format!r} is not understood")
    entries = [e for f in checkpoint_files(folder) for e in read_header(f)]
    plan = _rank_read_plan(cfg, entries, qcfg) if tp_size() > 1 else None
    stream = WeightStream(entries, plan)
    label = f"streamed, {stream.readers} reader threads"
    return _Source(iter(stream), stream.total_bytes(), label, lambda: stream.read_seconds)


def _rank_read_plan(cfg: ModelConfig, entries: list, qcfg=None) -> ReadPlan | None:
    """The rows this rank reads (weight_stream.plan_reads: the weight loaders run on a
    meta-device model; for an FP8 checkpoint its FP8 layers and the stream that routes weights
    and scales to them, as the real load does). None (read every tensor whole) if the dry run
    fails."""
    try:
        from atom_runtime.models.fp8_loading import checkpoint_loader

        meta = _construct(cfg, torch.float32, torch.device("meta"))
        return plan_reads(entries, checkpoint_loader(meta, qcfg))
    except Exception as e:  # a loader the dry run cannot follow: correct, only more bytes read
        log.debug("reading whole tensors: the read plan's dry run failed (%s)", e)
        return None


def _library(load_format: str, module: str, package: str):
    """The streaming library a load format needs, or a ValueError saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ValueError(
            f"load_format: {load_format} needs the {package} package (pip install {package})"
        ) from None


def _runai_source(folder: Path) -> _Source:
    streamer_class = _library(
        "runai_streamer", "runai_model_streamer", "runai-model-streamer"
    ).SafetensorsStreamer
    files = checkpoint_files(folder)
    total = sum(f.stat().st_size for f in files)

    def tensors():
        with streamer_class() as streamer:
            streamer.stream_files([str(f) for f in files])
            yield from streamer.get_tensors()

    return _Source(tensors(), total, "Run:ai model streamer")


def _fastsafetensors_source(folder: Path, device: torch.device) -> _Source:
    """fastsafetensors (vLLM's `--load-format fastsafetensors`): each shard copied to the device
    by its threads (pread through bounce buffers; no GPUDirect Storage), then its tensors handed
    out as device views, one shard at a time (at most one shard beside the model)."""
    loader_class = _library(
        "fastsafetensors", "fastsafetensors", "fastsafetensors"
    ).SafeTensorsFileLoader
    files = checkpoint_files(folder)
    total = sum(f.stat().st_size for f in files)
    target = str(device) if device.type == "cuda" else "cpu"

    def tensors():
        for file in files:
            loader = loader_class(None, target, nogds=True)
            try:
                loader.add_filenames({0: [str(file)]})
                buffers = loader.copy_files_to_device()
                try:
                    for key in loader.get_keys():
                        yield key, buffers.get_tensor(key)
                finally:
                    buffers.close()
            finally:
                loader.close()

    return _Source(tensors(), total, "fastsafetensors")


class _progress:
    """A tqdm bar over the weight bytes, on rank 0 only (a bar per rank would interleave)."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.label = total, label
        self.bar = None

    def __enter__(self) -> _progress:
        if tp_rank() == 0:
            self.bar = tqdm(
                total=self.total,
                desc="loading weights",
                unit="B",
                unit_scale=True,
                mininterval=0.5 if sys.stderr.isatty() else 5.0,
                leave=False,
            )
        return self

    def follow(self, tensors):
        for name, t in tensors:
            yield name, t
            if self.bar is not None:
                self.bar.update(_planned_bytes(t))

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()


def _planned_bytes(t) -> int:
    if isinstance(t, StreamedTensor):
        return sum(int(b.numel()) for b in t._parts.buffers)
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    return int(np.prod(t.shape)) * getattr(t, "itemsize", 2)


def _gguf_bytes(path: Path) -> int:
    """The dequantized (fp32) bytes of a GGUF file's tensors: what the bar counts."""
    return sum(int(np.prod(t.shape)) * 4 for t in open_gguf(path).tensors)


def build_mtp_head(
    path: Path,
    cfg: ModelConfig,
    target,
    load_format: str,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
):
    """The target's multi-token-prediction head (models/mtp.py), its tensors read from the
    target's checkpoint (`mtp.*`, DeepSeek's `model.layers.{num_hidden_layers + k}.*`) or dummy
    ones."""
    if cfg.num_nextn_predict_layers < 1:
        raise ValueError(f"{cfg.model_type}: the checkpoint declares no MTP layers")
    from atom_runtime.models import fp8_loading

    if cfg.is_hybrid:
        from atom_runtime.models.qwen3_next_mtp import Qwen3NextMtp as head_class
    elif cfg.mla is not None:
        from atom_runtime.models.deepseek_mtp import DeepseekMtp as head_class
    else:
        raise ValueError(
            f"{cfg.model_type}: no MTP head in this runtime for this family yet (Qwen3.5, "
            "Qwen3-Next and DeepSeek-V3 / R1 have theirs)"
        )
    with torch.device(device), _default_dtype(dtype):
        head = head_class(cfg, target)
    _to_run_dtype(head, dtype)
    if load_format == "dummy":
        _fill_dummy(head, seed)
        return head.eval()
    if is_gguf(path):
        raise ValueError("mtp: GGUF files carry no MTP head here")
    tensors = iter_safetensors(path if path.is_dir() else path.parent)
    loaded = head.load_weights(fp8_loading.mtp_head_stream(tensors, head, cfg, dtype))
    missing = {n for n, _ in head.named_parameters() if n not in loaded}
    if missing:
        raise ValueError(f"checkpoint is missing MTP tensors: {sorted(missing)[:8]}")
    return head.eval()


def _to_run_dtype(module, dtype: torch.dtype) -> None:
    """Cast a freshly built module to the run dtype; rotary tables and parameters marked
    `keep_fp32` (a MoE router, as trained) stay fp32."""
    module.to(dtype=dtype)
    for buf_name, buf in module.named_buffers():
        if buf_name.endswith("cos_sin_cache"):
            buf.data = buf.data.float()
    for param in module.parameters():
        if getattr(param, "keep_fp32", False):
            param.data = param.data.float()


def _is_tied(model, name: str) -> bool:
    return name == "lm_head.weight" and model.config.tie_word_embeddings


def _fill_dummy(model, seed: int) -> None:
    """Random weights small enough that activations stay finite through every layer."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if "norm" in name:
            param.data.fill_(1.0)
            continue
        gen = generators.get(param.device)
        if gen is None:
            gen = generators[param.device] = torch.Generator(param.device).manual_seed(seed)
        param.data.uniform_(-0.02, 0.02, generator=gen)

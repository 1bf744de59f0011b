"""`atom bench startup`: how fast weights load and a server becomes healthy, per load format, in
one run (issue 39's measurement; docs/serving.md, "Start-up").

    atom bench startup --model benchmarks/configs/llama-3.1-8b --dir /local/nvme/atom-startup
    atom bench startup --model default --dir /tmp/atom-startup --device cpu   # no GPU: 270 MB

1. Writes a real-sized checkpoint for the config (random bf16 safetensors in shards of
   `--shard-gb`, the default model's tokenizer beside it so `atom serve` can answer), unless
   `--dir` already holds one for the same config.
2. For each `--load-formats` entry, after dropping the checkpoint from the page cache
   (`posix_fadvise(DONTNEED)` on each file, and /proc/sys/vm/drop_caches when writable):
   - load: the weights into a model on the device in this process; prints GB/s (the bytes read
     over the weights_read phase) and the seconds until every weight was on the device;
   - serve (unless --no-serve): `atom serve DIR --load-format F`, timed from launch to /health
     200, with the server's own atom:startup_seconds phases.
3. Prints one table and, with --output-json, writes the figures.

Before the measured starts, one `atom serve` runs with an empty compile cache (a fresh folder
beside --dir, or --compile-cache-dir as it is): the first start, cold; every start measured after
it finds the cache warm (issue 39's first against second start).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import time
from pathlib import Path

from atom_runtime.system.process import LOG_LEVELS, log_level

MARKER = "atom-bench-startup.json"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="benchmarks/configs/llama-3.1-8b",
        help="the shape of the checkpoint to write: a folder with a Llama-family config.json, "
        "a GGUF file, or `default` (the default model's shape, SmolLM2-135M: 0.27 GB in bf16)",
    )
    p.add_argument(
        "--dir", required=True, help="where the checkpoint is written (a local disk: NVMe)"
    )
    p.add_argument("--shard-gb", type=float, default=5.0, help="size of each safetensors shard")
    p.add_argument(
        "--load-formats",
        default="safetensors,auto,fastsafetensors,runai_streamer",
        help="comma-separated --load-format values to compare, in this order (a library not "
        "installed gives its row an error, not the run)",
    )
    p.add_argument("--device", default="auto", help="where the weights go (auto: the GPU)")
    p.add_argument("--no-serve", action="store_true", help="skip the time-to-healthy runs")
    p.add_argument("--port", type=int, default=8765, help="port of the measured atom serve")
    p.add_argument(
        "--compile-cache-dir",
        default=None,
        help="passed to atom serve (default: a fresh folder beside --dir, emptied first)",
    )
    p.add_argument(
        "--serve-args", default="", help="more atom serve flags, one string (e.g. '-tp 2')"
    )
    p.add_argument("--keep", action="store_true", help="keep the checkpoint afterwards")
    p.add_argument("--output-json", default=None, help="write the figures here")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds a start may take")
    p.add_argument(
        "--log-level", type=log_level, default="warning", choices=LOG_LEVELS, help="log level"
    )


def run(args: argparse.Namespace) -> int:
    import torch

    from atom_runtime.models.config import ModelConfig

    folder = Path(args.dir)
    config_text = checkpoint_config_text(args.model)
    cfg = ModelConfig.from_hf(json.loads(config_text))
    nbytes = write_checkpoint(config_text, cfg, folder, args.shard_gb)
    formats = [f.strip() for f in args.load_formats.split(",") if f.strip()]
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)  # fmt: skip
    rows = []
    if not args.no_serve:
        rows.append(first_start(folder, formats[0], args))
        print(json.dumps(rows[0]), flush=True)
    for fmt in formats:
        row = {"load_format": fmt, "start": "warm", "checkpoint_gb": round(nbytes / 1e9, 2)}
        row["page_cache_dropped"] = drop_page_cache(folder)
        row.update(measure_load(folder, cfg, fmt, device))
        if not args.no_serve:
            row["page_cache_dropped_before_serve"] = drop_page_cache(folder)
            row.update(measure_serve(folder, fmt, args))
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(format_table(rows))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(rows, indent=2))
    if not args.keep:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


def first_start(folder: Path, fmt: str, args: argparse.Namespace) -> dict:
    """One `atom serve` with an empty compile cache (a fresh folder unless --compile-cache-dir
    names one): the cold start; it fills the cache every measured start after it finds warm."""
    if not args.compile_cache_dir:
        args.compile_cache_dir = str(folder.parent / f"{folder.name}-compile-cache")
        shutil.rmtree(args.compile_cache_dir, ignore_errors=True)
    drop_page_cache(folder)
    return {"load_format": fmt, "start": "first (compile cache as found: cold unless given)",
            **measure_serve(folder, fmt, args)}  # fmt: skip


def checkpoint_config_text(model: str) -> str:
    """The config.json of the checkpoint to write: the model folder's own, or, for a GGUF file
    (`default`: the default model's), a Llama config.json of the same shape."""
    from atom_runtime.models.source import default_model_path, is_gguf, load_model_config

    path = default_model_path() if model == "default" else Path(model)
    if not is_gguf(path):
        return (path / "config.json" if path.is_dir() else path).read_text()
    cfg = load_model_config(path)
    if cfg.model_type != "llama":
        raise ValueError(f"{path}: a {cfg.model_type} GGUF; the checkpoint writer is Llama's")
    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
              "rope_theta", "max_position_embeddings", "tie_word_embeddings", "bos_token_id")  # fmt: skip
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    config |= {name: getattr(cfg, name) for name in fields}
    config |= {"eos_token_id": cfg.eos_token_ids[0], "torch_dtype": "bfloat16"}
    return json.dumps(config, indent=2)


def checkpoint_tensors(cfg) -> dict[str, tuple[int, ...]]:
    """Hugging Face names and shapes of a Llama-family checkpoint for `cfg` (Qwen3's QK-norm
    and Qwen2's attention biases included)."""
    h, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
        if cfg.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)}
        if cfg.attention_bias:
            shapes |= {
                p + f"self_attn.{n}_proj.bias": (w,) for n, w in (("q", q), ("k", kv), ("v", kv))
            }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def write_checkpoint(config_text: str, cfg, folder: Path, shard_gb: float) -> int:
    """Random bf16 shards (small values: activations stay finite), an index, config.json and a
    tokenizer; skipped when `folder` already holds this config's checkpoint. Returns bytes."""
    import torch
    from safetensors.torch import save_file

    marker = folder / MARKER
    shapes = checkpoint_tensors(cfg)
    total = sum(2 * _numel(s) for s in shapes.values())
    if marker.is_file() and json.loads(marker.read_text()).get("config") == config_text:
        return total
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size, limit = 0, int(shard_gb * 1e9)
    for name, shape in shapes.items():
        if size and size + 2 * _numel(shape) > limit:
            shards.append({})
            size = 0
        t = torch.empty(shape, dtype=torch.bfloat16)
        if len(shape) > 1:
            t.uniform_(-0.02, 0.02, generator=gen)
        else:  # norms 1, biases 0
            t.fill_(0.0 if name.endswith(".bias") else 1.0)
        shards[-1][name] = t
        size += 2 * _numel(shape)
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, file)
        shard.clear()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_text(config_text)
    _write_tokenizer(folder)
    marker.write_text(json.dumps({"config": config_text}))
    return total


def _write_tokenizer(folder: Path) -> None:
    """The default model's tokenizer (its ids are a subset of any Llama vocabulary here)."""
    from atom_runtime.models.source import default_model_path
    from atom_runtime.text.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(default_model_path())
    tok.hf.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": tok.eos_token, "bos_token": tok.bos_token})
    )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def drop_page_cache(folder: Path) -> str:
    """Evict the checkpoint's files from the page cache: 'all' (drop_caches written), 'files'
    (posix_fadvise DONTNEED on each file: clean pages go) or 'no' (neither worked)."""
    done = "no"
    for f in folder.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            done = "files"
        except OSError:
            pass
        finally:
            os.close(fd)
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        done = "all"
    except OSError:
        pass
    return done


def measure_load(folder: Path, cfg, fmt: str, device) -> dict:
    """Load the weights into a model on `device` in this process: seconds and GB/s."""
    import torch

    from atom_runtime.models.loader import build_model
    from atom_runtime.system import startup

    phases = startup.restart()
    start = time.perf_counter()
    try:
        model = build_model(folder, cfg, fmt, torch.bfloat16, device)
    except (ValueError, ImportError, OSError) as e:
        return {"load_error": f"{type(e).__name__}: {e}"}
    seconds = time.perf_counter() - start
    gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    row = {"load_s": round(seconds, 2), "load_gb_per_s": round(gb / max(seconds, 1e-9), 2)}
    read_s = phases.seconds.get("weights_read")
    if read_s is not None and fmt != "dummy":  # dummy weights are made, not read
        row |= {
            "weights_read_s": round(read_s, 2),
            "read_gb_per_s": round(gb / max(read_s, 1e-9), 2),
        }
    return row


def measure_serve(folder: Path, fmt: str, args: argparse.Namespace) -> dict:
    """`atom serve` of the checkpoint: seconds from launch to /health 200, and its phases."""
    from atom_runtime.bench.processes import AtomProcess

    if _port_busy(args.port):
        return {"serve_error": f"port {args.port} is busy; pick another with --port"}
    serve_args = [str(folder), "--load-format", fmt, *args.serve_args.split()]
    if args.compile_cache_dir:
        serve_args += ["--compile-cache-dir", args.compile_cache_dir]
    log_path = folder.parent / f"atom-bench-startup-{fmt}.log"
    start = time.perf_counter()
    server = AtomProcess("serve", args.port, serve_args, log_path)
    try:
        server.wait_healthy(args.timeout)
        healthy = time.perf_counter() - start
        return {"time_to_healthy_s": round(healthy, 2), **_phases(server.url)}
    except RuntimeError as e:
        return {"serve_error": str(e)[-500:]}
    finally:
        server.stop()


def _phases(url: str) -> dict:
    import httpx

    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("atom:startup_seconds{"):
            phase = line.split('phase="', 1)[1].split('"', 1)[0]
            out[f"serve_{phase}_s"] = round(float(line.rsplit(" ", 1)[1]), 2)
    return out


def _port_busy(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def format_table(rows: list[dict]) -> str:
    cols = ["load_format", "start", "read_gb_per_s", "load_s", "time_to_healthy_s"]
    lines = [" | ".join(cols)]
    for row in rows:
        lines.append(" | ".join(str(row.get(c, row.get("load_error", "-"))) for c in cols))
    return "\n".join(lines)

"""What start-up compiles and measures, kept between starts: Triton's kernel cache and the
batch-1 kernel timings (kernel_choice.py), in `--compile-cache-dir` (default
~/.cache/atom/compile, under $XDG_CACHE_HOME when set).

Everything lives in a folder per key: the GPU model and its compute capability, the driver,
torch, Triton and ATOM versions (`cache_key`); a start on another GPU or with another version
gets a folder of its own, so a stale result is never used. In it:

    key.json           the key, readable
    triton/            TRITON_CACHE_DIR (set for this process and the workers it starts,
                       unless the variable is already set)
    kernel_timings.json   per layer group, the batch-1 path chosen; per weight shape, the GEMV
                       launch shape; for each ATOM_SMALL_M_KERNELS setting apart

A second start with the same key skips the timing of every group it finds (logged).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

TIMINGS_FILE = "kernel_timings.json"


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "atom" / "compile"


def cache_key(device) -> dict[str, str]:
    """What a kept result depends on: the device and the versions of everything that compiles
    or launches kernels."""
    import importlib.metadata

    import torch

    try:
        atom = importlib.metadata.version("atom-serving")
    except importlib.metadata.PackageNotFoundError:
        atom = "unknown"
    key = {"atom": atom, "torch": torch.__version__}
    try:
        import triton

        key["triton"] = triton.__version__
    except ImportError:
        key["triton"] = "none"
    if getattr(device, "type", "cpu") == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device)
        key["gpu"] = props.name
        key["capability"] = f"{props.major}.{props.minor}"
        key["cuda"] = str(torch.version.cuda or torch.version.hip)
        key["driver"] = _driver_version()
    else:
        key["gpu"] = "cpu"
    return key


def _driver_version() -> str:
    for path in ("/proc/driver/nvidia/version", "/sys/module/amdgpu/version"):
        try:
            return Path(path).read_text().split("\n", 1)[0].strip()
        except OSError:
            continue
    return "unknown"


class CompileCache:
    """The folder of one key under `root`, and the kernel timings kept in it."""

    def __init__(self, root: str | Path | None, key: dict[str, str]) -> None:
        self.key = key
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        self.dir = Path(root).expanduser() if root else default_cache_dir()
        self.dir = self.dir / digest
        self._timings: dict | None = None

    def prepare(self) -> CompileCache:
        """Create the folder (with key.json) and point Triton's cache into it."""
        try:
            (self.dir / "triton").mkdir(parents=True, exist_ok=True)
            (self.dir / "key.json").write_text(json.dumps(self.key, indent=2))
        except OSError as e:  # read-only home: run without the cache, say so once
            log.warning(
                "compile cache %s unusable (%s); start-up timings are not kept", self.dir, e
            )
            return self
        os.environ.setdefault("TRITON_CACHE_DIR", str(self.dir / "triton"))
        return self

    # -- kernel timings ------------------------------------------------------------------------

    def _load(self) -> dict:
        if self._timings is None:
            try:
                self._timings = json.loads((self.dir / TIMINGS_FILE).read_text())
            except (OSError, ValueError):
                self._timings = {}
        return self._timings

    def _section(self, mode: str) -> dict:
        return self._load().setdefault(mode, {"paths": {}, "launch_shapes": {}})

    def path(self, mode: str, group: str) -> str | None:
        """The batch-1 path kept for a layer group under `mode`, if any."""
        return self._section(mode)["paths"].get(group)

    def launch_shape(self, mode: str, n: int, k: int) -> dict[str, int] | None:
        return self._section(mode)["launch_shapes"].get(f"{n}x{k}")

    def put_path(self, mode: str, group: str, path: str) -> None:
        self._section(mode)["paths"][group] = path

    def put_launch_shape(self, mode: str, n: int, k: int, shape: dict[str, int]) -> None:
        self._section(mode)["launch_shapes"][f"{n}x{k}"] = dict(shape)

    def save(self) -> None:
        """Write the timings (atomically: a concurrent start reads the old or the new file)."""
        if self._timings is None:
            return
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            tmp = self.dir / f".{TIMINGS_FILE}.{os.getpid()}"
            tmp.write_text(json.dumps(self._timings, indent=2, sort_keys=True))
            tmp.replace(self.dir / TIMINGS_FILE)
        except OSError as e:
            log.warning("could not keep the kernel timings in %s: %s", self.dir, e)


def open_compile_cache(root: str | None, device) -> CompileCache:
    """The prepared cache for this device (key from `cache_key`)."""
    return CompileCache(root, cache_key(device)).prepare()

"""Streaming a safetensors checkpoint: parallel reads of the bytes this rank needs, running ahead
of the copies to the device.

The safetensors library reads a tensor when it is asked for (a memory-mapped file, page faults
one after another, in the loading thread): disk reads and host-to-device copies alternate, at
the page-fault readahead's queue depth. Here a pool of reader threads (`os.preadv`, which
releases the GIL) reads the tensors in file order, each split into chunks, into host buffers,
up to `max_ahead_bytes` ahead of the loading thread, which copies them to the device meanwhile:
the disk sees many requests at once and is never idle while a copy runs. Shards of a sharded
checkpoint are read the same way (the plan spans every file), so they are read in parallel.

Under tensor parallelism a rank reads only its shard's bytes where the format allows: a dry run
of the model's weight loaders on the meta device (`plan_reads`) records which rows of each
checkpoint tensor this rank takes (`narrow` along dim 0, contiguous in a row-major file); a
tensor sliced along another dim (columns: strided bytes, every page touched anyway) or taken
whole is read whole.

Layout of a .safetensors file: an 8-byte little-endian header length, a JSON header mapping each
tensor name to {dtype, shape, data_offsets [begin, end)} relative to the end of the header, then
the data.
"""

from __future__ import annotations

import json
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

CHUNK_BYTES = 16 << 20  # one read request; large enough for the disk, small enough to spread
MAX_AHEAD_BYTES = 2 << 30  # host memory the readers may fill ahead of the copies
DEFAULT_READERS = 8

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip
_SAFETENSORS_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes are: `begin`/`end` are absolute offsets in `file`."""

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def row_bytes(self) -> int:
        rows = self.shape[0] if self.shape else 1
        return (self.end - self.begin) // max(rows, 1)


def read_header(path: Path) -> list[TensorEntry]:
    """The tensors of one .safetensors file, in the order their bytes lie in it."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    base = 8 + n
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {name!r} has dtype {info['dtype']}, not supported")
        begin, end = info["data_offsets"]
        entries.append(
            TensorEntry(name, path, dtype, tuple(info["shape"]), base + begin, base + end)
        )
    return sorted(entries, key=lambda e: e.begin)


def checkpoint_files(folder: Path) -> list[Path]:
    """The .safetensors files of a checkpoint (the index's, when it has one)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        names = sorted(p.name for p in folder.glob("*.safetensors"))
    if not names:
        raise FileNotFoundError(f"{folder}: no *.safetensors files")
    return [folder / name for name in names]


# -- what this rank reads ------------------------------------------------------------------------


@dataclass
class ReadPlan:
    """Per tensor name: the row ranges [start, stop) this rank reads, or None for the whole."""

    rows: dict[str, list[tuple[int, int]] | None] = field(default_factory=dict)

    def ranges(self, entry: TensorEntry) -> list[tuple[int, int]]:
        """Absolute byte ranges of `entry` to read (merged, in file order)."""
        rows = self.rows.get(entry.name)
        if rows is None:
            return [(entry.begin, entry.end)]
        merged: list[list[int]] = []
        for start, stop in sorted(rows):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], stop)
            else:
                merged.append([start, stop])
        rb = entry.row_bytes
        return [(entry.begin + a * rb, entry.begin + b * rb) for a, b in merged]


class _Recorder:
    """A checkpoint tensor for the dry run: it records the rows asked for and hands out meta
    tensors of the right shape, so the weight loaders run through without data."""

    def __init__(self, entry: TensorEntry, plan: ReadPlan, dtype: torch.dtype | None = None):
        self.entry, self.plan, self.name = entry, plan, entry.name
        self.shape = torch.Size(entry.shape)
        self.dtype = entry.dtype if dtype is None or _kept(entry.dtype) else dtype
        plan.rows.setdefault(entry.name, [])

    def dim(self) -> int:
        return len(self.shape)

    @property
    def stored_dtype(self) -> str:
        return _SAFETENSORS_NAMES[self.entry.dtype]

    def to(self, dtype: torch.dtype) -> _Recorder:
        return _Recorder(self.entry, self.plan, dtype)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        rows = self.plan.rows[self.name]
        if dim == 0 and rows is not None:
            rows.append((start, start + length))
        else:
            self.plan.rows[self.name] = None
        return torch.empty(self.shape, dtype=self.dtype, device="meta").narrow(dim, start, length)

    def read(self) -> torch.Tensor:
        self.plan.rows[self.name] = None
        return torch.empty(self.shape, dtype=self.dtype, device="meta")


def plan_reads(
    entries: list[TensorEntry], load_into_meta: Callable[[Iterator], object]
) -> ReadPlan:
    """Which rows of each tensor this rank's weight loaders take: `load_into_meta(weights)`
    runs the model's `load_weights` on a meta-device copy of the model."""
    plan = ReadPlan()
    load_into_meta((e.name, _Recorder(e, plan)) for e in entries)
    for name, rows in plan.rows.items():
        if rows == []:  # never narrowed, never read: skipped by the model
            plan.rows[name] = []
    return plan


# -- reading ---------------------------------------------------------------------------------------


class StreamedTensor:
    """A checkpoint tensor whose bytes (this rank's rows, or all) are being read in the
    background; `narrow`, `read` and `to` behave as the lazy safetensors tensor's do."""

    def __init__(self, entry: TensorEntry, parts, dtype: torch.dtype | None = None) -> None:
        self.entry, self.name, self._parts = entry, entry.name, parts
        self.shape = torch.Size(entry.shape)
        self.dtype = dtype

    def dim(self) -> int:
        return len(self.shape)

    @property
    def stored_dtype(self) -> str:
        """The dtype in the file, as safetensors names it ("BF16", "F8_E4M3", ...)."""
        return _SAFETENSORS_NAMES[self.entry.dtype]

    def to(self, dtype: torch.dtype) -> StreamedTensor:
        return StreamedTensor(self.entry, self._parts, dtype)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if not 0 <= dim < self.dim() or start < 0 or length < 0 or start + length > self.shape[dim]:
            raise ValueError(
                f"{self.name}: [{start}, {start + length}) is outside dim {dim} of "
                f"{tuple(self.shape)}"
            )
        if dim == 0:
            for first_row, rows in self._parts.views(self.entry):
                if first_row <= start and start + length <= first_row + rows.shape[0]:
                    return self._convert(rows.narrow(0, start - first_row, length))
        return self._convert(self._whole().narrow(dim, start, length))

    def read(self) -> torch.Tensor:
        return self._convert(self._whole())

    def _whole(self) -> torch.Tensor:
        views = self._parts.views(self.entry)
        if len(views) != 1 or views[0][0] != 0 or views[0][1].shape != self.shape:
            raise RuntimeError(f"{self.name}: only some rows were read, not the whole tensor")
        return views[0][1]

    def _convert(self, t: torch.Tensor) -> torch.Tensor:
        if self.dtype is None or _kept(t.dtype):
            return t
        return t.to(self.dtype)


def _kept(dtype: torch.dtype) -> bool:
    """Whether a stored dtype stays as it is under `to(run dtype)`: integer and FP8 tensors
    (quantized blocks, FP8 weights), as in the loader's CheckpointTensor. Only a loader that
    knows their scales knows what they mean; a cast would drop the scales silently."""
    return not dtype.is_floating_point or dtype.itemsize == 1


class _Parts:
    """The buffers of one tensor's byte ranges, filled by the reader pool."""

    def __init__(self, ranges: list[tuple[int, int]], futures: list[Future], buffers) -> None:
        self.ranges, self.futures, self.buffers = ranges, futures, buffers

    def wait(self) -> None:
        for f in self.futures:
            f.result()

    def views(self, entry: TensorEntry) -> list[tuple[int, torch.Tensor]]:
        self.wait()
        rb = entry.row_bytes
        out = []
        for (a, _), buf in zip(self.ranges, self.buffers, strict=True):
            rows = buf.numel() // rb if entry.shape else 1
            shape = (rows, *entry.shape[1:]) if entry.shape else ()
            out.append(((a - entry.begin) // rb if rb else 0, buf.view(entry.dtype).view(shape)))
        return out


class WeightStream:
    """Every planned tensor of a checkpoint in file order, read ahead by `readers` threads.
    Iterate to get (name, StreamedTensor); `read_seconds` / `read_bytes` say how long the
    reading took (until the last byte) and how much it read."""

    def __init__(
        self,
        entries: list[TensorEntry],
        plan: ReadPlan | None = None,
        readers: int = DEFAULT_READERS,
        max_ahead_bytes: int = MAX_AHEAD_BYTES,
        on_bytes: Callable[[int], None] | None = None,
    ) -> None:
        self.entries = [e for e in entries if plan is None or plan.rows.get(e.name, None) != []]
        self.plan = plan or ReadPlan()
        self.readers = readers
        self.max_ahead_bytes = max_ahead_bytes
        self.on_bytes = on_bytes
        self.read_bytes = 0
        self.read_seconds = 0.0
        self._lock = threading.Lock()
        self._fds: dict[Path, int] = {}

    def total_bytes(self) -> int:
        return sum(b - a for e in self.entries for a, b in self.plan.ranges(e))

    def __iter__(self) -> Iterator[tuple[str, StreamedTensor]]:
        start = time.perf_counter()
        pool = ThreadPoolExecutor(self.readers, thread_name_prefix="weight-reader")
        ahead: list[tuple[TensorEntry, _Parts, int]] = []
        queued = 0
        nxt = 0
        try:
            for _ in range(len(self.entries)):
                while nxt < len(self.entries) and (not ahead or queued < self.max_ahead_bytes):
                    parts, size = self._submit(pool, self.entries[nxt])
                    ahead.append((self.entries[nxt], parts, size))
                    queued += size
                    nxt += 1
                entry, parts, size = ahead.pop(0)
                parts.wait()
                self.read_seconds = time.perf_counter() - start
                queued -= size
                yield entry.name, StreamedTensor(entry, parts)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def _submit(self, pool: ThreadPoolExecutor, entry: TensorEntry) -> tuple[_Parts, int]:
        fd = self._fds.get(entry.file)
        if fd is None:
            fd = self._fds[entry.file] = os.open(entry.file, os.O_RDONLY)
        ranges = self.plan.ranges(entry)
        buffers, futures = [], []
        for a, b in ranges:
            buf = torch.empty(b - a, dtype=torch.uint8)
            view = memoryview(buf.numpy())
            for at in range(a, b, CHUNK_BYTES):
                n = min(CHUNK_BYTES, b - at)
                futures.append(pool.submit(self._read, fd, view[at - a : at - a + n], at))
            buffers.append(buf)
        return _Parts(ranges, futures, buffers), sum(b - a for a, b in ranges)

    def _read(self, fd: int, into: memoryview, offset: int) -> None:
        done = 0
        while done < len(into):
            n = os.preadv(fd, [into[done:]], offset + done)
            if n <= 0:
                raise OSError(f"short read at byte {offset + done} of a safetensors file")
            done += n
        with self._lock:
            self.read_bytes += done
        if self.on_bytes is not None:
            self.on_bytes(done)

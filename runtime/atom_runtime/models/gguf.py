"""Reading a GGUF file's metadata and tensor table (no torch: the tokenizer reads its vocabulary
from here too, and start-up checks read the architecture before any process starts).

Our own reader of the header, because `gguf.GGUFReader` builds a numpy view per element of every
metadata array: the default model's 49,152-token vocabulary and its merges took 13-18 s to open
on a busy 2-core machine, and a start-up opened the file three times (config, weights,
tokenizer). This one decodes the header with `struct` in one pass and builds numeric arrays with
one `np.frombuffer` each (a few hundred milliseconds on the same machine). Tensor data stays
memory-mapped and is read on access; `gguf.quants` (the well-kept library) dequantizes it.

Layout (GGUF v2/v3, little-endian): magic "GGUF", version u32, tensor count u64, metadata count
u64; metadata as (string key, u32 type, value); tensor infos as (string name, u32 n_dims,
u64 dims[n_dims] innermost first, u32 ggml type, u64 offset); the data section starts at the
next multiple of `general.alignment` (default 32) and every offset is relative to it.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# GGUF value types -> struct format of one scalar (8: string, 9: array are handled apart).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}  # fmt: skip
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8",
          11: "<i8", 12: "<f8"}  # fmt: skip
_STRING, _ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32


@dataclass
class GGUFTensor:
    """One tensor of the file: `shape` in ggml order (innermost first, as the gguf library
    reports it), `data` a read-only view of its bytes in the memory map, shaped for
    `gguf.quants.dequantize` (rows x bytes for quantized types, the element array otherwise)."""

    name: str
    shape: np.ndarray
    tensor_type: int
    data: np.ndarray

    @property
    def n_bytes(self) -> int:
        return self.data.nbytes


class GGUFFile:
    """A GGUF file's metadata (`fields`: key -> Python value) and tensors (`tensors`)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = memoryview(self._map)
        if bytes(buf[:4]) != b"GGUF":
            raise ValueError(f"{self.path}: not a GGUF file (no GGUF magic)")
        version, n_tensors, n_fields = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (2 or 3)")
        reader = _Cursor(buf, 24)
        self.fields: dict[str, object] = {}
        for _ in range(n_fields):
            key = reader.string()
            self.fields[key] = reader.value(reader.u32())
        infos = [_tensor_info(reader) for _ in range(n_tensors)]
        alignment = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-reader.at // alignment) * alignment
        self.tensors = [_tensor(self._map, start, *info) for info in infos]


def _tensor_info(reader: _Cursor) -> tuple[str, list[int], int, int]:
    name = reader.string()
    dims = [reader.u64() for _ in range(reader.u32())]
    return name, dims, reader.u32(), reader.u64()


def _tensor(data_map: mmap.mmap, start: int, name: str, dims: list[int], kind: int, offset: int):
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    qtype = GGMLQuantizationType(kind)
    block, type_size = GGML_QUANT_SIZES[qtype]
    count = int(np.prod(dims)) if dims else 1
    n_bytes = count // block * type_size
    raw = np.frombuffer(data_map, dtype=np.uint8, count=n_bytes, offset=start + offset)
    rows = tuple(reversed(dims[1:]))
    if qtype == GGMLQuantizationType.F32:
        data = raw.view(np.float32).reshape(*rows, dims[0])
    elif qtype == GGMLQuantizationType.F16:
        data = raw.view(np.float16).reshape(*rows, dims[0])
    else:  # quantized (and bf16): bytes per row, as gguf.quants expects
        data = raw.reshape(*rows, dims[0] // block * type_size)
    return GGUFTensor(name, np.array(dims, dtype=np.uint64), int(kind), data)


class _Cursor:
    """Reads little-endian GGUF values from a buffer, moving forward."""

    def __init__(self, buf: memoryview, at: int) -> None:
        self.buf = buf
        self.at = at

    def u32(self) -> int:
        (v,) = struct.unpack_from("<I", self.buf, self.at)
        self.at += 4
        return v

    def u64(self) -> int:
        (v,) = struct.unpack_from("<Q", self.buf, self.at)
        self.at += 8
        return v

    def string(self) -> str:
        n = self.u64()
        text = bytes(self.buf[self.at : self.at + n]).decode("utf-8", errors="replace")
        self.at += n
        return text

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            return self.array(self.u32(), self.u64())
        fmt = _SCALARS.get(kind)
        if fmt is None:
            raise ValueError(f"GGUF metadata value type {kind} is not understood")
        (v,) = struct.unpack_from(fmt, self.buf, self.at)
        self.at += struct.calcsize(fmt)
        return v

    def array(self, kind: int, count: int) -> list:
        if kind in _NUMPY:  # one frombuffer for the whole array
            values = np.frombuffer(self.buf, dtype=_NUMPY[kind], count=count, offset=self.at)
            self.at += values.nbytes
            return values.tolist()
        if kind == _STRING:
            return self._strings(count)
        return [self.value(kind) for _ in range(count)]  # arrays of arrays: rare, small

    def _strings(self, count: int) -> list[str]:
        buf, at, out = self.buf, self.at, []
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            (n,) = unpack(buf, at)
            at += 8
            out.append(str(buf[at : at + n], "utf-8", "replace"))
            at += n
        self.at = at
        return out


def open_gguf(path: Path) -> GGUFFile:
    """The GGUF file at `path`: metadata decoded, tensors memory-mapped (read on access)."""
    return GGUFFile(path)


def gguf_field(reader: GGUFFile, key: str, default=None):
    """The value of metadata field `key`, or `default` when the file has none."""
    return reader.fields.get(key, default)

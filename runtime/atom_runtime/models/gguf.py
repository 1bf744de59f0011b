"""Reading a GGUF file's metadata (no torch: the tokenizer reads its vocabulary from here too)."""

from __future__ import annotations

from pathlib import Path


def open_gguf(path: Path):
    """A reader of the GGUF file at `path` (tensors are memory-mapped, read on access)."""
    import gguf

    return gguf.GGUFReader(str(path))


def gguf_field(reader, key: str, default=None):
    """The value of metadata field `key`, or `default` when the file has none."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()

"""A GGUF file's header, read without llama.cpp: its metadata and every tensor's bytes.

The report needs the weight bytes llama.cpp reads per token (every tensor but the token
embedding table, which a token only indexes, unless tied) beside those a rank reads.
A tensor's size is the distance to the next tensor's offset (the last one's to the end of
the file): that holds for every tensor type, quantized or not, padding included.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
EMBEDDING_TENSOR = "token_embd.weight"
HEAD_TENSOR = "output.weight"
# metadata value types -> struct format (8: string, 9: array are read apart)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q"}
_SCALARS |= {11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9


class GGUFError(ValueError):
    """The bytes are not a GGUF file this reader understands."""


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    metadata: dict[str, Any]
    tensor_bytes: dict[str, int]  # name -> bytes in the file

    def weight_bytes_per_token(self) -> int:
        """Bytes a decode step reads: every tensor, the embedding table only when the model
        is tied (no ``output.weight``: llama.cpp's LM head is then that table, read whole
        every token; otherwise a token only indexes one row of it)."""
        if HEAD_TENSOR not in self.tensor_bytes:
            return sum(self.tensor_bytes.values())
        return sum(size for name, size in self.tensor_bytes.items() if name != EMBEDDING_TENSOR)


def _read(stream: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    chunk = stream.read(size)
    if len(chunk) != size:
        raise GGUFError("the file ends inside its header")
    return struct.unpack(fmt, chunk)[0]


def _string(stream: BinaryIO) -> str:
    length = _read(stream, "<Q")
    raw = stream.read(length)
    if len(raw) != length:
        raise GGUFError("the file ends inside a string")
    return raw.decode("utf-8", errors="replace")


def _value(stream: BinaryIO, kind: int) -> Any:
    if kind == STRING:
        return _string(stream)
    if kind == ARRAY:
        item_kind, count = _read(stream, "<I"), _read(stream, "<Q")
        return [_value(stream, item_kind) for _ in range(count)]
    if kind not in _SCALARS:
        raise GGUFError(f"unknown metadata value type {kind}")
    return _read(stream, _SCALARS[kind])


def read_header(stream: BinaryIO, file_size: int) -> GGUFHeader:
    """Parse ``stream`` (at its start) of a GGUF file of ``file_size`` bytes."""
    if stream.read(4) != MAGIC:
        raise GGUFError("not a GGUF file (no GGUF magic)")
    version, tensors, entries = _read(stream, "<I"), _read(stream, "<Q"), _read(stream, "<Q")
    metadata = {}
    for _ in range(entries):
        key = _string(stream)
        metadata[key] = _value(stream, _read(stream, "<I"))
    offsets: dict[str, int] = {}
    for _ in range(tensors):
        name = _string(stream)
        dims = _read(stream, "<I")
        for _ in range(dims):
            _read(stream, "<Q")
        _read(stream, "<I")  # the tensor's type: its size comes from the offsets
        offsets[name] = _read(stream, "<Q")
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    data_start = -(-stream.tell() // alignment) * alignment
    return GGUFHeader(version, metadata, _sizes(offsets, file_size - data_start))


def _sizes(offsets: dict[str, int], data_bytes: int) -> dict[str, int]:
    ordered = sorted(offsets.items(), key=lambda item: item[1])
    ends = [offset for _, offset in ordered[1:]] + [data_bytes]
    sizes = {name: end - offset for (name, offset), end in zip(ordered, ends, strict=True)}
    if any(size <= 0 for size in sizes.values()):
        raise GGUFError("tensor offsets overlap or run past the end of the file")
    return sizes

"""An ONNX segment read without its weights' bytes: each initializer's bytes stay in the
file, and the initializer points at them as ONNX external data (location, offset, length).

Composing a piece (``shardserve.runtime.compose``) needs the segments' graphs, not their
weights; ``onnx.load`` would parse every weight into memory (the whole slice at TP 1, and
a capped agent has room for little more than its weights once). Read here, a segment is a
few kB; onnxruntime reads the weights from the rank's files when it opens the composed
model (given the rank folder). A ``raw_data`` field is the tensor's bytes as they are, so
its place in the protobuf encoding is the external data's offset. Only the protobuf wire
format is walked here; the small messages are parsed by onnx.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from pathlib import Path

import onnx

from shardserve.errors import InternalError

__all__ = ["graph_inputs", "light_model"]

_MODEL_GRAPH = 7  # ModelProto.graph
_GRAPH_INITIALIZER = 5  # GraphProto.initializer
_GRAPH_INPUT = 11  # GraphProto.input
_TENSOR_RAW_DATA = 9  # TensorProto.raw_data
_LENGTH_DELIMITED = 2
# Smaller tensors (shapes, axes, scalars) stay inline: the graph optimizer reads them.
INLINE_BYTES = 4096


def light_model(path: Path) -> onnx.ModelProto:
    """The model at ``path`` with its big ``raw_data`` initializers as external data of
    ``path.name`` (the caller opens it with the file's folder as the external data folder)."""
    with path.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        model = onnx.ModelProto()
        rest = bytearray()
        graph = None
        for field, tag, start, end in _fields(data, 0, len(data)):
            if field == _MODEL_GRAPH:
                graph = _light_graph(data, start, end, path.name)
            else:
                rest += data[tag:end]
        model.ParseFromString(bytes(rest))
        if graph is None:
            raise InternalError(f"{path.name} holds no graph")
        model.graph.CopyFrom(graph)
        return model


def graph_inputs(path: Path) -> tuple[str, ...]:
    """The names of the graph's inputs, without reading the rest of the file."""
    with path.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        for field, _, start, end in _fields(data, 0, len(data)):
            if field == _MODEL_GRAPH:
                return tuple(
                    onnx.ValueInfoProto.FromString(data[s:e]).name
                    for f, _, s, e in _fields(data, start, end)
                    if f == _GRAPH_INPUT
                )
    raise InternalError(f"{path.name} holds no graph")


def _light_graph(data: mmap.mmap, start: int, end: int, location: str) -> onnx.GraphProto:
    rest = bytearray()
    tensors = []
    for field, tag, s, e in _fields(data, start, end):
        if field == _GRAPH_INITIALIZER:
            tensors.append(_light_tensor(data, s, e, location))
        else:
            rest += data[tag:e]
    graph = onnx.GraphProto.FromString(bytes(rest))
    graph.initializer.extend(tensors)
    return graph


def _light_tensor(data: mmap.mmap, start: int, end: int, location: str) -> onnx.TensorProto:
    rest = bytearray()
    raw: tuple[int, int] | None = None
    for field, tag, s, e in _fields(data, start, end):
        if field == _TENSOR_RAW_DATA and e - s >= INLINE_BYTES:
            raw = (s, e - s)
        else:
            rest += data[tag:e]
    tensor = onnx.TensorProto.FromString(bytes(rest))
    if raw is not None:
        tensor.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", location), ("offset", raw[0]), ("length", raw[1])):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, str(value)
    return tensor


def _fields(data: mmap.mmap, start: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """(field number, tag offset, value start, value end) of each field of a message
    encoded in ``data[start:end]`` (for a length-delimited field, its payload)."""
    at = start
    while at < end:
        tag = at
        key, at = _varint(data, at)
        field, wire = key >> 3, key & 7
        if wire == _LENGTH_DELIMITED:
            length, at = _varint(data, at)
            yield field, tag, at, at + length
            at += length
            continue
        if wire == 0:
            _, value_end = _varint(data, at)
        elif wire in (1, 5):
            value_end = at + (8 if wire == 1 else 4)
        else:
            raise InternalError(f"unsupported protobuf wire type {wire} at byte {tag}")
        yield field, tag, at, value_end
        at = value_end
    if at != end:
        raise InternalError(f"protobuf message overruns its length at byte {at}")


def _varint(data: mmap.mmap, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7

"""Checking a model's external data locations before loading it.

onnxruntime follows ``location`` entries of external tensors relative to the model file;
a hostile slice could point them at ``/etc/shadow`` or ``../../other``. The agent calls
``check_external_data`` first: it parses the model without loading any data and refuses
any location that is absolute, contains '..', or resolves (through symlinks) outside the
model's folder.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path, PurePosixPath, PureWindowsPath

import onnx
from onnx import external_data_helper

from shardserve.errors import RepositoryError, UnsafePathError


def check_external_data(model_path: Path) -> list[str]:
    """Return the relative external data files of a model (sorted, unique), or raise
    UnsafePathError for a location that leaves the model's folder."""
    try:
        model = onnx.load(str(model_path), load_external_data=False)
    except Exception as exc:  # protobuf DecodeError and friends
        raise RepositoryError(f"{model_path} is not a readable ONNX model: {exc}") from exc
    folder = model_path.parent.resolve()
    files: set[str] = set()
    for tensor in _all_tensors(model):
        if not external_data_helper.uses_external_data(tensor):
            continue
        location = next((e.value for e in tensor.external_data if e.key == "location"), "")
        files.add(_confined(folder, location, tensor.name, model_path))
    return sorted(files)


def _confined(folder: Path, location: str, tensor: str, model_path: Path) -> str:
    where = f"{model_path}: external data of tensor {tensor!r} at {location!r}"
    if not location:
        raise UnsafePathError(f"{where} has no location")
    posix, windows = PurePosixPath(location), PureWindowsPath(location)
    if posix.is_absolute() or windows.is_absolute() or windows.drive or location.startswith("\\"):
        raise UnsafePathError(f"{where} is an absolute path; it must be relative to the model")
    if ".." in posix.parts or ".." in windows.parts:
        raise UnsafePathError(f"{where} contains '..'; it must stay inside {folder}")
    target = (folder / location).resolve()
    if target != folder and folder not in target.parents:
        raise UnsafePathError(f"{where} resolves to {target}, outside {folder}")
    return location


def _all_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Initializers and tensor attributes of the graph, its subgraphs and functions."""
    yield from _graph_tensors(model.graph)
    for function in model.functions:
        for node in function.node:
            yield from _node_tensors(node)


def _graph_tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    yield from graph.initializer
    for node in graph.node:
        yield from _node_tensors(node)


def _node_tensors(node: onnx.NodeProto) -> Iterator[onnx.TensorProto]:
    for attr in node.attribute:
        if attr.HasField("t"):
            yield attr.t
        yield from attr.tensors
        if attr.HasField("g"):
            yield from _graph_tensors(attr.g)
        for sub in attr.graphs:
            yield from _graph_tensors(sub)

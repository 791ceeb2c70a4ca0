"""One copy of a weight that several of a rank's segments hold (same name, same bytes).

A rank's segments are separate ONNX models (the pieces between collectives, or several
methods over one backbone); each onnxruntime session would load its own copy of every
initializer. Here each weight found in two or more segments with identical bytes is read
once into a numpy array, wrapped in an ``OrtValue`` (which references the array, no copy)
and given to every session that uses it with ``SessionOptions.add_initializer``. The
arrays and OrtValues must outlive the sessions: ``SharedWeights`` holds them and lives in
the ``LoadedSlice`` next to the sessions.

Sessions that receive a shared weight run with weight prepacking off: onnxruntime
otherwise makes a packed private copy of a MatMul weight in every session, which would
cost more than it saves (measured: two sessions over one 100 MB weight take ~200 MB
unshared, ~300 MB shared with prepacking, ~100 MB shared without).
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import external_data_helper, numpy_helper

_logger = logging.getLogger(__name__)

# Sharing a tiny tensor saves nothing and would turn prepacking off for no reason.
MIN_SHARED_BYTES = 64 * 1024

Fingerprint = tuple[int, tuple[int, ...], str]  # (onnx data type, dims, sha256 of bytes)


@dataclass
class SharedWeights:
    """Weights shared between segments: name -> OrtValue, and which segment uses which."""

    values: dict[str, ort.OrtValue] = field(default_factory=dict)
    users: dict[str, tuple[str, ...]] = field(default_factory=dict)  # weight -> segments
    arrays: dict[str, np.ndarray] = field(default_factory=dict)  # keeps OrtValues' memory

    def for_segment(self, segment: str) -> dict[str, ort.OrtValue]:
        return {name: value for name, value in self.values.items() if segment in self.users[name]}

    @property
    def nbytes(self) -> int:
        return sum(array.nbytes for array in self.arrays.values())


def find_shared_weights(segments: Mapping[str, Path]) -> SharedWeights:
    """Read the shared weights of these segment files (name -> path; paths already
    verified and their external data confined)."""
    if len(segments) < 2:
        return SharedWeights()
    seen: dict[tuple[str, Fingerprint], list[str]] = {}
    for segment, path in segments.items():
        for name, fingerprint in _fingerprints(path):
            seen.setdefault((name, fingerprint), []).append(segment)
    shared = {name: tuple(users) for (name, _), users in seen.items() if len(users) > 1}
    # A name with different bytes in different segments is not one weight: leave it alone.
    variants = Counter(name for name, _ in seen)
    shared = {name: users for name, users in shared.items() if variants[name] == 1}
    return _read(segments, shared)


def _read(segments: Mapping[str, Path], shared: dict[str, tuple[str, ...]]) -> SharedWeights:
    weights = SharedWeights(users=shared)
    by_source: dict[str, list[str]] = {}
    for name, users in shared.items():
        by_source.setdefault(users[0], []).append(name)
    for segment, names in by_source.items():
        path = segments[segment]
        model = onnx.load(str(path), load_external_data=False)
        wanted = set(names)
        for tensor in model.graph.initializer:
            if tensor.name in wanted:
                # a copy that owns its memory: to_array may return a view of the proto
                array = np.array(numpy_helper.to_array(tensor, str(path.parent)), order="C")
                weights.arrays[tensor.name] = array
                weights.values[tensor.name] = ort.OrtValue.ortvalue_from_numpy(array)
    return weights


def _fingerprints(path: Path) -> Iterator[tuple[str, Fingerprint]]:
    """(name, fingerprint) of the segment's initializers big enough to be worth sharing."""
    model = onnx.load(str(path), load_external_data=False)
    for tensor in model.graph.initializer:
        digest = _digest(tensor, path.parent)
        if digest is not None:
            yield tensor.name, (tensor.data_type, tuple(tensor.dims), digest)


def _digest(tensor: onnx.TensorProto, folder: Path) -> str | None:
    h = hashlib.sha256()
    if external_data_helper.uses_external_data(tensor):
        info = external_data_helper.ExternalDataInfo(tensor)
        if info.length is not None and info.length < MIN_SHARED_BYTES:
            return None
        with (folder / info.location).open("rb") as fh:
            fh.seek(info.offset or 0)
            remaining = info.length
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                if remaining is not None:
                    chunk = chunk[:remaining]
                    remaining -= len(chunk)
                h.update(chunk)
                if remaining == 0:
                    break
        return h.hexdigest()
    data = tensor.raw_data if tensor.HasField("raw_data") else None
    if data is None:
        if tensor.ByteSize() < MIN_SHARED_BYTES:
            return None
        data = numpy_helper.to_array(tensor).tobytes()
    if len(data) < MIN_SHARED_BYTES:
        return None
    h.update(data)
    return h.hexdigest()

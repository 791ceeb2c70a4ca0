"""A rank's segments: which files its stage program runs, their compile-cache identity,
the weights they share, and opening them. One rule for everyone who opens a slice.

The agent, ``shardserve warmup`` and the standalone per-rank run (``shardserve.lite``)
all open a rank through here, so they compute the same compile-cache key and a cache
built by one is a hit for the others. The key of a segment is made of:

* its *identity*: the segment's sha256, combined with its external data files' sha256s
  when it has some (the .onnx alone does not pin the weights);
* the names of the *shared weights* handed to its session: each weight found in two or
  more of the rank's segments with identical bytes is read once into a numpy array,
  wrapped in an ``OrtValue`` (which references the array, no copy) and given to every
  session that uses it with ``SessionOptions.add_initializer``.

Sessions that receive a shared weight run with weight prepacking off: onnxruntime
otherwise makes a packed private copy of a MatMul weight in every session, which would
cost more than it saves (measured: two sessions over one 100 MB weight take ~200 MB
unshared, ~300 MB shared with prepacking, ~100 MB shared without).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import external_data_helper, numpy_helper

from shardserve.errors import RepositoryError, UnsafePathError
from shardserve.repo.external import check_external_data
from shardserve.repo.repository import (
    GroupConfig,
    RunOp,
    StageSpec,
    rank_checksum,
    verify_rank_files,
)
from shardserve.runtime.compile_cache import CacheStatus, CompileCache
from shardserve.runtime.program import OrtSegment

# Sharing a tiny tensor saves nothing and would turn prepacking off for no reason.
MIN_SHARED_BYTES = 64 * 1024

Fingerprint = tuple[int, tuple[int, ...], str]  # (onnx data type, dims, sha256 of bytes)


# ---------------------------------------------------------------- which files


@dataclass(frozen=True)
class Segment:
    """One segment the rank's program runs, and its identity for the compile cache."""

    path: Path
    identity: str


def segment_files(
    stage: StageSpec, files: Mapping[str, Path], digests: Mapping[str, str]
) -> tuple[dict[str, Path], dict[str, str]]:
    """The segments the stage program runs (name -> path), and each one's identity.

    ``files`` are the rank's verified files (name -> path), ``digests`` their sha256s from
    group.json. Each segment is checked for external data that would leave the rank
    folder or was not checksummed (raises UnsafePathError).
    """
    segments: dict[str, Path] = {}
    identities: dict[str, str] = {}
    for op in stage.program:
        if not isinstance(op, RunOp) or op.file in segments:
            continue
        if op.file not in files:
            raise RepositoryError(f"stage {stage.index} runs {op.file}, not a file of this rank")
        path = files[op.file]
        data_files = check_external_data(path)
        unlisted = [data for data in data_files if data not in files]
        if unlisted:
            raise UnsafePathError(
                f"{path}: external data file(s) {', '.join(unlisted)} not listed "
                f"(with their sha256) among the rank's files in group.json"
            )
        segments[op.file] = path
        identities[op.file] = (
            rank_checksum({n: digests[n] for n in (op.file, *data_files)})
            if data_files
            else digests[op.file]
        )
    return segments, identities


def rank_segments(repo: Path, group: GroupConfig, rank: int) -> dict[str, Segment]:
    """Verify the rank's files against their sha256; return the segments it runs."""
    files = verify_rank_files(repo, group, rank)
    paths, identities = segment_files(group.stage_of(rank), files, group.ranks[rank].files)
    return {name: Segment(path, identities[name]) for name, path in paths.items()}


# ---------------------------------------------------------------- shared weights


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
    if external_data_helper.uses_external_data(tensor):
        return _external_digest(tensor, folder)
    data = tensor.raw_data if tensor.HasField("raw_data") else None
    if data is None:
        if tensor.ByteSize() < MIN_SHARED_BYTES:
            return None
        data = numpy_helper.to_array(tensor).tobytes()
    if len(data) < MIN_SHARED_BYTES:
        return None
    return hashlib.sha256(data).hexdigest()


def _external_digest(tensor: onnx.TensorProto, folder: Path) -> str | None:
    info = external_data_helper.ExternalDataInfo(tensor)
    if info.length is not None and info.length < MIN_SHARED_BYTES:
        return None
    h = hashlib.sha256()
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


# ---------------------------------------------------------------- opening


class SharingSegment(OrtSegment):
    """An OrtSegment that keeps the shared weights its session reads alive."""

    def __init__(self, session: ort.InferenceSession, weights: SharedWeights) -> None:
        super().__init__(session)
        self.weights = weights


def open_segments(
    cache: CompileCache, segments: Mapping[str, Segment], shared: SharedWeights
) -> tuple[dict[str, OrtSegment], CacheStatus]:
    """One session per segment through the cache (shared weights handed in), and the
    overall cache status."""
    runners: dict[str, OrtSegment] = {}
    statuses: list[CacheStatus] = []
    for name, segment in segments.items():
        session, status = cache.open(segment.path, segment.identity, shared.for_segment(name))
        runners[name] = SharingSegment(session, shared)
        statuses.append(status)
    return runners, overall_status(statuses)


def overall_status(statuses: list[CacheStatus]) -> CacheStatus:
    """'hit' only if every segment came from the cache; 'off' if none used it."""
    if not statuses or all(s == "off" for s in statuses):
        return "off"
    if all(s == "hit" for s in statuses):
        return "hit"
    return "miss"

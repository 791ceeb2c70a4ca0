"""Find a rank's slice from a path and open it through the compile cache.

The model path is either a version folder of a model repository
(``models/matmul/1``, then the rank comes from the context) or one rank's folder
(``models/matmul/1/rank_3``, which names the rank itself). Only that rank's files (and
the version's group.json) are read; every file is checked against its sha256 first.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

from shardserve.compile_cache import CacheStatus, CompileCache
from shardserve.errors import RepositoryError, UnsafePathError
from shardserve.lite.errors import ModelPathError
from shardserve.program import OrtSegment
from shardserve.repository import (
    GROUP_FILE,
    GroupConfig,
    RunOp,
    load_group,
    rank_checksum,
    verify_rank_files,
)
from shardserve.slicing.external import check_external_data

_RANK_FOLDER = re.compile(r"rank_(\d+)")


@dataclass(frozen=True)
class SliceLocation:
    """Where a version lives in its repository, and the rank the path named (if any)."""

    repo: Path
    servable: str
    version: int
    rank: int | None


@dataclass(frozen=True)
class OpenedSlice:
    runners: dict[str, OrtSegment]
    cache: CacheStatus
    load_ms: float


def locate(path: Path) -> SliceLocation:
    """Read a version folder or rank folder path (see the module doc)."""
    folder = path.expanduser().resolve()
    rank: int | None = None
    match = _RANK_FOLDER.fullmatch(folder.name)
    if match and (folder.parent / GROUP_FILE).is_file():
        rank, folder = int(match.group(1)), folder.parent
    if not (folder / GROUP_FILE).is_file():
        raise ModelPathError(
            f"{path} is not a model version folder (no {GROUP_FILE}) nor a rank_<r> folder "
            f"inside one; pass e.g. models/matmul/1 or models/matmul/1/rank_0"
        )
    if not folder.name.isdigit():
        raise ModelPathError(f"{folder} holds {GROUP_FILE} but its name is not a version number")
    return SliceLocation(folder.parent.parent, folder.parent.name, int(folder.name), rank)


def load_version(location: SliceLocation) -> GroupConfig:
    return load_group(location.repo, location.servable, location.version)


@dataclass(frozen=True)
class Segment:
    """One segment the rank's program runs, and its identity for the compile cache."""

    path: Path
    identity: str


def rank_segments(repo: Path, group: GroupConfig, rank: int) -> dict[str, Segment]:
    """Verify the rank's files; return the segments its stage program runs.

    The identity is the segment's sha256, combined with its external data files' when it
    has some (the .onnx alone does not pin the weights) -- the agent's rule
    (``shardserve_agent.slice_loader.segment_files``), so the cache keys agree.
    """
    files = verify_rank_files(repo, group, rank)
    digests = group.ranks[rank].files
    segments: dict[str, Segment] = {}
    for op in group.stage_of(rank).program:
        if not isinstance(op, RunOp) or op.file in segments:
            continue
        if op.file not in files:
            raise RepositoryError(f"rank {rank} runs {op.file}, not a file of this rank")
        data_files = check_external_data(files[op.file])
        unlisted = [data for data in data_files if data not in files]
        if unlisted:
            raise UnsafePathError(
                f"{files[op.file]}: external data file(s) {', '.join(unlisted)} not listed "
                f"(with their sha256) among the rank's files in group.json"
            )
        identity = (
            rank_checksum({n: digests[n] for n in (op.file, *data_files)})
            if data_files
            else digests[op.file]
        )
        segments[op.file] = Segment(files[op.file], identity)
    return segments


def open_slice(
    location: SliceLocation, group: GroupConfig, rank: int, cache: CompileCache
) -> OpenedSlice:
    """Verify the rank's files, then open one session per segment through the cache."""
    segments = rank_segments(location.repo, group, rank)
    started = time.perf_counter()
    runners: dict[str, OrtSegment] = {}
    statuses: list[CacheStatus] = []
    for name, segment in segments.items():
        session, status = cache.open(segment.path, segment.identity)
        runners[name] = OrtSegment(session)
        statuses.append(status)
    return OpenedSlice(runners, overall_status(statuses), (time.perf_counter() - started) * 1000)


def overall_status(statuses: list[CacheStatus]) -> CacheStatus:
    """'hit' only if every segment came from the cache; 'off' if none used it."""
    if not statuses or all(s == "off" for s in statuses):
        return "off"
    if all(s == "hit" for s in statuses):
        return "hit"
    return "miss"

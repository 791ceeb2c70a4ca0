"""Find a rank's slice from a path and open it through the compile cache.

The model path is either a version folder of a model repository
(``models/matmul/1``, then the rank comes from the context) or one rank's folder
(``models/matmul/1/rank_3``, which names the rank itself). Only that rank's files (and
the version's group.json) are read; every file is checked against its sha256 first.
Segments, cache identities and shared weights follow ``shardserve.runtime.segments`` (the agent's
rule), so the compile-cache keys agree.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

from shardserve.lite.errors import ModelPathError
from shardserve.repo.repository import GROUP_FILE, GroupConfig, load_group, version_of_folder
from shardserve.runtime.compile_cache import CacheStatus, CompileCache
from shardserve.runtime.program import OrtSegment
from shardserve.runtime.segments import find_shared_weights, open_segments, rank_segments

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
    version = version_of_folder(folder.name)
    if version is None:
        raise ModelPathError(
            f"{folder} holds {GROUP_FILE} but its name is not a version number "
            "(1, 2, ... in ASCII digits, no leading zero)"
        )
    return SliceLocation(folder.parent.parent, folder.parent.name, version, rank)


def load_version(location: SliceLocation) -> GroupConfig:
    return load_group(location.repo, location.servable, location.version)


def open_slice(
    location: SliceLocation, group: GroupConfig, rank: int, cache: CompileCache
) -> OpenedSlice:
    """Verify the rank's files, then open one session per segment through the cache, with
    the weights its segments share handed in once (as the agent does: same cache keys)."""
    segments = rank_segments(location.repo, group, rank)
    started = time.perf_counter()
    shared = find_shared_weights({name: segment.path for name, segment in segments.items()})
    runners, status = open_segments(cache, segments, shared)
    return OpenedSlice(runners, status, (time.perf_counter() - started) * 1000)

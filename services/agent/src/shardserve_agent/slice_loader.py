"""Load one rank's slice: check its files, then open one onnxruntime session per segment.

Only ``<repo>/<servable>/<version>/rank_<r>/`` is read (plus group.json); other ranks'
folders are never opened. Every file of the rank (segments and their external data) is
checked against its sha256; sessions are opened only for the segments the stage program
runs, after ``check_external_data`` proved each one's external data stays in the rank
folder and is among the checksummed files. Weights several segments share are loaded
once. Which segments, their cache identities and their shared weights follow the one rule
of ``shardserve.runtime.segments`` (``shardserve warmup`` and ``shardserve.lite`` use it too, so
their compile-cache entries are hits here).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from shardserve.errors import RepositoryError
from shardserve.process.heap import return_freed_memory
from shardserve.repo.pack import missing_slice_message
from shardserve.repo.repository import (
    GroupConfig,
    StageSpec,
    list_versions,
    load_group,
    rank_checksum,
    rank_dir,
    verify_rank_files,
)
from shardserve.runtime.compile_cache import CacheStatus, CompileCache, SessionConfig
from shardserve.runtime.kv_shape import is_generation
from shardserve.runtime.pieces import ComposedRank, Piece, open_pieces
from shardserve.runtime.program import OrtSegment
from shardserve.runtime.segments import (
    Segment,
    SharedWeights,
    find_shared_weights,
    open_segments,
    segment_files,
)
from shardserve_agent.settings import AgentSettings

_logger = logging.getLogger(__name__)
_MIB = 1024 * 1024
# What running out of memory says: a failed malloc/new, or a thread whose stack did not
# fit (onnxruntime: pthread_create's EAGAIN; Python: "can't start new thread").
_ALLOCATION_WORDS = (
    "alloc",
    "memory",
    "resource temporarily unavailable",
    "can't start new thread",
)


class SliceTooLargeError(Exception):
    """The slice does not fit under the configured memory cap."""


@dataclass(frozen=True)
class LoadedSlice:
    """A rank's slice, ready to run."""

    group: GroupConfig
    rank: int
    stage: StageSpec
    runners: dict[str, OrtSegment]
    checksum: str
    cache: CacheStatus
    load_ms: float
    disk_bytes: int
    # Holds the arrays behind the sessions' shared initializers: must live as long as they do.
    shared_weights: SharedWeights = field(default_factory=SharedWeights)
    # Composed pieces (``--fused``) by the program index of their first op; their segments'
    # runners in ``runners`` run over the pieces' sessions.
    pieces: dict[int, Piece] = field(default_factory=dict)

    @property
    def is_leader(self) -> bool:
        return self.group.leader_of(self.stage.index) == self.rank


def resolve_version(repo: Path, servable: str, version: int | None) -> int:
    """The requested version, or the highest one the repository holds for the servable."""
    if version is not None:
        return version
    versions = list_versions(repo, servable)
    if not versions:
        raise RepositoryError(f"servable {servable!r} has no version in repository {repo}")
    return versions[-1]


def load_slice(settings: AgentSettings) -> LoadedSlice:
    """Verify this rank's files and open its sessions (raises SliceTooLargeError on a cap)."""
    try:
        return _load(settings)
    except Exception as exc:
        if settings.max_memory_mb is not None and _is_allocation_failure(exc):
            raise SliceTooLargeError(
                f"loading rank {settings.rank} slice ({_disk_bytes(settings) / _MIB:.1f} MB on "
                f"disk) exceeds the memory cap of {settings.max_memory_mb} MB "
                f"({type(exc).__name__}: {exc})"
            ) from exc
        raise


def _load(settings: AgentSettings) -> LoadedSlice:
    version = resolve_version(settings.repository, settings.servable, settings.version)
    group = load_group(settings.repository, settings.servable, version)
    if 0 <= settings.rank < group.rank_size:  # (outsiders are refused by the scheduler)
        missing = missing_slice_message(settings.repository, group, settings.rank)
        if missing:
            raise RepositoryError(missing)
    files = verify_rank_files(settings.repository, group, settings.rank)
    disk_bytes = sum(path.stat().st_size for path in files.values())
    stage = group.stage_of(settings.rank)
    digests = group.ranks[settings.rank].files
    paths, identities = segment_files(stage, files, digests)
    cache = CompileCache(
        settings.resolved_cache_dir(version),
        settings.rank,
        SessionConfig(
            intra_op_threads=settings.threads, inter_op_threads=1, mode=settings.cache_mode
        ),
    )
    started = time.perf_counter()
    composed = _composed(settings, group, stage, files, cache.config)
    paths = {name: path for name, path in paths.items() if name not in composed.runners}
    shared = find_shared_weights(paths) if settings.share_weights else SharedWeights()
    segments = {name: Segment(path, identities[name]) for name, path in paths.items()}
    runners, status = open_segments(cache, segments, shared)
    runners.update(composed.runners)
    return_freed_memory()  # the model parse buffers: RSS should be the weights, not twice
    load_ms = (time.perf_counter() - started) * 1000
    _logger.info(
        "rank %d slice loaded: %d segment(s) (%d in %d composed piece(s)), %.1f MB on disk, "
        "compile cache %s (%s), %d shared weight(s) of %.1f MB, %.0f ms",
        settings.rank,
        len(runners),
        len(composed.runners),
        len(composed.pieces),
        disk_bytes / _MIB,
        status,
        settings.cache_mode,
        len(shared.values),
        shared.nbytes / _MIB,
        load_ms,
    )
    return LoadedSlice(
        group=group,
        rank=settings.rank,
        stage=stage,
        runners=runners,
        checksum=rank_checksum(group.ranks[settings.rank].files),
        cache=status,
        load_ms=load_ms,
        disk_bytes=disk_bytes,
        shared_weights=shared,
        pieces=composed.pieces,
    )


def _composed(
    settings: AgentSettings,
    group: GroupConfig,
    stage: StageSpec,
    files: dict[str, Path],
    config: SessionConfig,
) -> ComposedRank:
    """The rank's composed pieces (``--fused``, generation servables), else none."""
    if not (settings.fused and is_generation(group)):
        return ComposedRank({}, {})
    try:
        return open_pieces(stage, files, lambda: config.options(True))
    except MemoryError:
        raise
    except Exception as exc:  # a slice the composition does not take still serves
        _logger.warning(
            "rank %d: not composing its pieces (%s: %s); one session per segment",
            settings.rank,
            type(exc).__name__,
            exc,
        )
        return ComposedRank({}, {})


def _disk_bytes(settings: AgentSettings) -> int:
    """Size of the rank's folder, for messages (0 if it cannot be read)."""
    try:
        version = resolve_version(settings.repository, settings.servable, settings.version)
        folder = rank_dir(settings.repository, settings.servable, version, settings.rank)
        return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    except Exception:  # only used to word an error message
        return 0


def _is_allocation_failure(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or what caused it, e.g. a MemoryError while parsing the model)
    is running out of memory."""
    while exc is not None:
        if isinstance(exc, MemoryError):
            return True
        text = str(exc).lower()
        if any(w in text for w in _ALLOCATION_WORDS):
            return True
        exc = exc.__cause__
    return False

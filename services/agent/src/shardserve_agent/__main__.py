"""``python -m shardserve_agent``: load this rank's slice, then serve it until SIGTERM.

Exit codes: 0 clean stop, 1 fatal error (e.g. the slice does not load or does not fit the
memory cap), 2 usage error, 3 registration refused by the scheduler.
"""

from __future__ import annotations

import os

if __name__ == "__main__":
    # One OpenBLAS thread unless the environment says otherwise: by default it starts one per
    # core, each with a 32 MiB buffer and an 8 MiB stack that --max-memory-mb counts (72 of
    # the 141 MiB a 2-core agent had before loading), and the agent's numpy work (attention
    # over its rank's heads, sampling) is small next to its onnxruntime threads (--threads).
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import asyncio
import logging
import sys
from pathlib import Path

from shardserve.errors import ChecksumError, ShardserveError, UnsafePathError
from shardserve.process.lifecycle import run_service, setup_logging
from shardserve.repo.pack import missing_slice_message
from shardserve.repo.repository import (
    GroupConfig,
    list_versions,
    load_group,
    rank_checksum,
    rank_dir,
    sha256_file,
    verify_rank_files,
)
from shardserve_agent.generation.kv_budget import make_kv_cache
from shardserve_agent.memory_cap import prepare_memory
from shardserve_agent.outsider import report_outside_rank
from shardserve_agent.service import EXIT_REFUSED, AgentService
from shardserve_agent.settings import AgentSettings, parse_settings
from shardserve_agent.slice_loader import SliceTooLargeError, load_slice

_logger = logging.getLogger("shardserve_agent")

EXIT_FATAL = 1


def _unservable(settings: AgentSettings) -> tuple[GroupConfig, str, str] | None:
    """(group, reason, checksum on disk) when this rank cannot be served here: outside the
    group, its slice not on this host, or a slice whose checksum differs; else None."""
    try:
        version = settings.version or max(list_versions(settings.repository, settings.servable))
        group = load_group(settings.repository, settings.servable, version)
    except (ValueError, ShardserveError):
        return None  # load_slice reports what is wrong with the repository
    rank = settings.rank
    if not 0 <= rank < group.rank_size:
        return group, f"rank {rank} is outside the group (rank_size {group.rank_size})", ""
    missing = missing_slice_message(settings.repository, group, rank)
    if missing:
        return group, missing, ""
    try:
        verify_rank_files(settings.repository, group, rank)
    except ChecksumError as exc:
        return group, str(exc), _checksum_on_disk(settings.repository, group, rank)
    return None


def _checksum_on_disk(repo: Path, group: GroupConfig, rank: int) -> str:
    folder = rank_dir(repo, group.servable, group.version, rank)
    files = {
        name: sha256_file(folder / name) if (folder / name).is_file() else ""
        for name in group.ranks[rank].files
    }
    return rank_checksum(files)


def main(argv: list[str] | None = None) -> int:
    settings = parse_settings(argv)
    setup_logging("agent")
    unservable = _unservable(settings)
    if unservable is not None:
        group, reason, checksum = unservable
        _logger.error("cannot serve rank %d of %s here: %s", settings.rank, group.servable, reason)
        asyncio.run(report_outside_rank(settings, group, reason, checksum))
        return EXIT_REFUSED
    try:
        prepare_memory(settings)
        loaded = load_slice(settings)
    except SliceTooLargeError as exc:
        _logger.error("%s", exc)
        return EXIT_FATAL
    except UnsafePathError as exc:  # e.g. external data pointing outside the rank folder
        _logger.error("refusing to start rank %d of %s: %s", settings.rank, settings.servable, exc)
        return EXIT_FATAL
    except Exception as exc:  # any load failure is fatal; say what it was
        _logger.error(
            "cannot load rank %d of %s: %s: %s",
            settings.rank,
            settings.servable,
            type(exc).__name__,
            exc,
        )
        return EXIT_FATAL
    # Empty at every start: a restarted agent has lost its sequences (their steps fail).
    service = AgentService(settings, loaded, make_kv_cache(settings, loaded))
    try:
        code = run_service(service.run)
    except ShardserveError as exc:  # e.g. no broker within SHARDSERVE_AMQP_CONNECT_WAIT
        _logger.error("agent %s failed: %s", service.instance, exc)
        return EXIT_FATAL
    except Exception:
        _logger.exception("agent %s failed", service.instance)
        return EXIT_FATAL
    return service.exit_code or code


if __name__ == "__main__":
    sys.exit(main())

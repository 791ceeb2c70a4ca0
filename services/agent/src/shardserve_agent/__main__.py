"""``python -m shardserve_agent``: load this rank's slice, then serve it until SIGTERM.

Exit codes: 0 clean stop, 1 fatal error (e.g. the slice does not load or does not fit the
memory cap), 2 usage error, 3 registration refused by the scheduler.
"""

from __future__ import annotations

import asyncio
import logging
import sys

from shardserve.errors import ShardserveError, UnsafePathError
from shardserve.lifecycle import run_service, setup_logging
from shardserve.repository import GroupConfig, list_versions, load_group
from shardserve_agent.outsider import report_outside_rank
from shardserve_agent.service import EXIT_REFUSED, AgentService
from shardserve_agent.settings import AgentSettings, parse_settings
from shardserve_agent.slice_loader import SliceTooLargeError, apply_memory_cap, load_slice

_logger = logging.getLogger("shardserve_agent")

EXIT_FATAL = 1


def _outside_rank(settings: AgentSettings) -> tuple[GroupConfig, str] | None:
    """The group and a reason when ``--rank`` is not a rank of the group, else None."""
    try:
        version = settings.version or max(list_versions(settings.repository, settings.servable))
        group = load_group(settings.repository, settings.servable, version)
    except (ValueError, ShardserveError):
        return None  # load_slice reports what is wrong with the repository
    if 0 <= settings.rank < group.rank_size:
        return None
    return group, f"rank {settings.rank} is outside the group (rank_size {group.rank_size})"


def main(argv: list[str] | None = None) -> int:
    settings = parse_settings(argv)
    setup_logging("agent")
    outside = _outside_rank(settings)
    if outside is not None:
        group, reason = outside
        asyncio.run(report_outside_rank(settings, group, reason))
        return EXIT_REFUSED
    try:
        apply_memory_cap(settings.max_memory_mb)
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
    service = AgentService(settings, loaded)
    try:
        code = run_service(service.run)
    except Exception:
        _logger.exception("agent %s failed", service.instance)
        return EXIT_FATAL
    return service.exit_code or code


if __name__ == "__main__":
    sys.exit(main())

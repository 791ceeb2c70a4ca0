"""``python -m shardserve_scheduler --repository DIR [...]``: run the scheduler."""

from __future__ import annotations

import logging
import sys

from shardserve.errors import RepositoryError, ShardserveError
from shardserve.process.lifecycle import run_service, setup_logging
from shardserve_scheduler.service import SchedulerService
from shardserve_scheduler.settings import parse_settings

_logger = logging.getLogger("shardserve_scheduler")


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 clean stop, 1 fatal error, 2 usage error (from argparse)."""
    settings = parse_settings(argv)
    setup_logging("scheduler")
    try:
        service = SchedulerService(settings)
    except RepositoryError as exc:
        _logger.error("cannot start: %s", exc)
        return 1
    try:
        return run_service(service.run)
    except ShardserveError as exc:  # e.g. no broker within SHARDSERVE_AMQP_CONNECT_WAIT
        _logger.error("scheduler failed: %s", exc)
        return 1
    except Exception as exc:  # the last line of defence: say why, exit 1
        _logger.exception("scheduler failed: %s", exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())

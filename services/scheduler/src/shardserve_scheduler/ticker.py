"""Time in the core: heartbeat timeouts, deadlines, batch delays and finished unloads.

One task runs ``Ticker.run``: it ticks every ``TICK_SECONDS``, or sooner when a machine
wants one (``Machines.until_due``: a batch falls due, a deadline passes).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from shardserve_scheduler.core.registry import Registry
from shardserve_scheduler.machines import Machines
from shardserve_scheduler.readiness import ReadinessLog
from shardserve_scheduler.repository_changes import RepositoryChanges

_logger = logging.getLogger(__name__)

TICK_SECONDS = 0.1


class Ticker:
    """Ticks the registry, the machines and the repository's unloads."""

    def __init__(
        self,
        registry: Registry,
        machines: Machines,
        changes: RepositoryChanges,
        readiness: ReadinessLog,
        *,
        status_changed: Callable[[], None],
        clock: Callable[[], float],
    ) -> None:
        self._registry = registry
        self._machines = machines
        self._changes = changes
        self._readiness = readiness
        self._status_changed = status_changed
        self._clock = clock

    async def run(self) -> None:
        while True:
            await self._machines.until_due(TICK_SECONDS)
            self.tick(self._clock())

    def tick(self, now: float) -> None:
        for loss in self._registry.tick(now):
            _logger.warning("%s", loss.message)
            self._machines.on_rank_lost(loss, now)
        for failure in self._registry.expired_waits(now):
            _logger.error("%s", failure)
            self._status_changed()
        self._machines.tick(now)
        if self._changes.finish_unloads():
            self._readiness.accept()
        self._readiness.check()

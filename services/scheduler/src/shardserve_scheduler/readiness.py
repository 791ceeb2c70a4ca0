"""The groups' readiness as last announced: each change logged once, and broadcast.

A group turns ready when its last rank registers and unready when one is lost; the
registry knows the current state, this remembers the one the mesh was last told about,
so a change is logged once (``<group> is ready`` or why it is not) and triggers a status.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from shardserve_scheduler.core.registry import Registry

_logger = logging.getLogger(__name__)


class ReadinessLog:
    """Compares the registry's readiness with the last announced one."""

    def __init__(self, registry: Registry, changed: Callable[[], None]) -> None:
        self._registry = registry
        self._changed = changed
        self._announced = registry.readiness()

    def check(self) -> None:
        """Log each group whose readiness changed, and ask for a status, if any did."""
        readiness = self._registry.readiness()
        if readiness == self._announced:
            return
        for key, ready in sorted(readiness.items()):
            if self._announced.get(key) != ready:
                group = self._registry.groups[key]
                _logger.info("%s", f"{group.name} is ready" if ready else group.not_ready_reason())
        self._announced = readiness
        self._changed()

    def accept(self) -> None:
        """Take the current readiness as announced (groups unloaded: no change to log)."""
        self._announced = self._registry.readiness()

"""MeshStatus, broadcast by the active scheduler every --status-interval and on change.

Gateways follow one scheduler's status (which servables exist, which groups are ready,
the queues' depths), so a standby stays silent. ``changed`` asks for a status at once
(a group turned ready or unready, this scheduler took over, the repository changed).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from shardserve.amqp.broker import Broker
from shardserve.errors import InferenceError
from shardserve.process.waits import set_within
from shardserve.wire import topology
from shardserve_scheduler.core.catalog import Catalog
from shardserve_scheduler.core.registry import Registry
from shardserve_scheduler.core.status import mesh_status
from shardserve_scheduler.machines import Machines

_logger = logging.getLogger(__name__)


class StatusBroadcast:
    """Owns the "status changed" event and the loop that answers it."""

    def __init__(
        self,
        scheduler_id: str,
        broker: Broker,
        catalog: Catalog,
        registry: Registry,
        machines: Machines,
        *,
        request_queue: str,
        interval_s: float,
        is_active: Callable[[], bool],
        counted_dead: Callable[[], int],
        clock: Callable[[], float],
    ) -> None:
        self._scheduler_id = scheduler_id
        self._broker = broker
        self._catalog = catalog
        self._registry = registry
        self._machines = machines
        self._clock = clock
        self._request_queue = request_queue
        self._interval_s = interval_s
        self._is_active = is_active
        self._counted_dead = counted_dead  # requests this scheduler dead-lettered itself
        self._changed = asyncio.Event()

    def changed(self) -> None:
        """Send a status now rather than at the next interval."""
        self._changed.set()

    async def run(self) -> None:
        while True:
            await set_within(self._changed, self._interval_s)
            self._changed.clear()
            if self._is_active():  # a standby stays silent: gateways follow one scheduler
                await self._publish()

    async def _publish(self) -> None:
        dead, waiting = await self._queue_depths()
        status = mesh_status(
            self._scheduler_id,
            self._catalog,
            self._registry,
            self._machines.inference,
            self._clock(),
            generation=self._machines.generation,
            dead_lettered=dead,
            request_queue_depth=waiting,
        )
        try:
            await self._broker.publish(
                topology.CONTROL_EXCHANGE, topology.KEY_SCHEDULER_STATUS, status
            )
        except InferenceError as exc:
            _logger.warning("could not publish the mesh status: %s", exc)

    async def _queue_depths(self) -> tuple[int, int]:
        """Dead letters of every service (they all share one dead-letter queue) and requests
        waiting; when the broker cannot say, what this scheduler counted itself."""
        try:
            dead = await self._broker.ready_count(topology.DEAD_LETTER_QUEUE)
            waiting = await self._broker.ready_count(self._request_queue)
        except InferenceError:
            return self._counted_dead() + self._broker.dead_lettered, 0
        return dead, waiting

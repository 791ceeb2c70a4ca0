"""The request machine's state and queries: open requests, jobs, lanes, statistics.

``RequestMachine`` (``requests``) is built in layers, one concept per module:
``MachineState`` (this: what is open, and lookups) <- ``Replies`` (ending instances and
requests) <- ``JobOutcomes`` (a job's stage results, its end or failure) <- ``Progress``
(instances moving through steps: Python tasks, batching, queueing and publishing jobs)
<- ``RequestMachine`` (the events the shell calls, and admission). A layer calls the
layers above it directly, and the few methods of later layers through the hooks below.
"""

from __future__ import annotations

from shardserve_scheduler.core.actions import Action
from shardserve_scheduler.core.batching import Batcher, Member
from shardserve_scheduler.core.jobs import (
    Call,
    Counters,
    Job,
    Lane,
    LaneKey,
    RequestState,
    VersionStats,
)
from shardserve_scheduler.core.methods import PythonStep

PyKey = tuple[LaneKey, str, int]  # (servable version, method, step position)


class MachineState:
    """Owns every open request, instance and job of the scheduler."""

    def __init__(
        self,
        *,
        result_to: str,
        id_prefix: str,
        max_inflight: int = 64,
        queue_factor: int = 10,
        max_batch_size: int = 32,
        batch_delay: float = 0.002,
    ) -> None:
        self.result_to = result_to
        self.max_inflight = max(1, max_inflight)
        self.max_queued = queue_factor * self.max_inflight
        self.max_batch_size = max(1, max_batch_size)
        self.batch_delay = max(0.0, batch_delay)
        self.counters = Counters()
        self.requests: dict[str, RequestState] = {}
        self.jobs: dict[str, Job] = {}
        self.stats: dict[LaneKey, VersionStats] = {}
        self._lanes: dict[LaneKey, Lane] = {}
        self._py_waiting: dict[PyKey, tuple[PythonStep, list[tuple[str, int]]]] = {}
        self._py_tasks: dict[str, tuple[PyKey, list[tuple[str, int]]]] = {}
        self._prefix = id_prefix
        self._next_id = 0

    def inflight(self, servable: str, version: int) -> int:
        lane = self._lanes.get((servable, version))
        return len(lane.inflight) if lane else 0

    def queued(self, servable: str, version: int) -> int:
        lane = self._lanes.get((servable, version))
        return lane.waiting if lane else 0

    def version_stats(self, servable: str, version: int) -> VersionStats:
        return self.stats.get((servable, version), VersionStats())

    def open_for(self, servable: str, version: int) -> int:
        return sum(1 for s in self.requests.values() if s.call.lane_key == (servable, version))

    @property
    def open_requests(self) -> int:
        return len(self.requests)

    def next_wakeup(self) -> float | None:
        """When the earliest open batch is due (the shell ticks then), or None. Lanes whose
        stages are all busy wait for a job completion instead (no tick needed)."""
        dues = [
            lane.batcher.next_due()
            for lane in self._lanes.values()
            if lane.batcher is not None and lane.hungry
        ]
        known = [d for d in dues if d is not None]
        return min(known) if known else None

    def forget(self, servable: str, version: int) -> None:
        """Drop an unloaded version's lane and statistics (it has no open request)."""
        self._lanes.pop((servable, version), None)
        self.stats.pop((servable, version), None)

    # ------------------------------------------------------------------ lookups

    def _lane(self, call: Call) -> Lane:
        lane = self._lanes.get(call.lane_key)
        if lane is None:
            group = call.group
            limit = group.max_batch_size or self.max_batch_size
            batches = group.with_batch_dim and (group.max_batch_size > 0 or limit > 1)
            stacks = not group.with_batch_dim and limit > 1
            # Stacking never waits for company: instances leave at once while a stage is
            # free, and pile up into one job only while every stage is busy (Lane.hungry).
            delay = 0.0 if stacks else self.batch_delay
            batcher = Batcher(limit, delay) if batches or stacks else None
            lane = Lane(group, batcher, call.method.no_batch_inputs, stacking=stacks)
            self._lanes[call.lane_key] = lane
        return lane

    def _new_id(self, kind: str) -> str:
        self._next_id += 1
        return f"{self._prefix}-{kind}{self._next_id}"

    def _alive(self, key: str, index: int, position: int) -> RequestState | None:
        """The request, if this instance is still open and at this step."""
        state = self.requests.get(key)
        if state is None:
            return None
        instance = state.instances[index]
        return state if instance.outcome is None and instance.step == position else None

    def _live_members(self, job: Job) -> list[Member]:
        return [m for m in job.members if self._alive(m[0], m[1], m[3])]

    # ------------------------------------------------------------------ hooks (later layers)

    def _advance(self, state: RequestState, index: int, now: float) -> list[Action]:
        raise NotImplementedError  # Progress

    def _prune(self, state: RequestState, now: float) -> list[Action]:
        raise NotImplementedError  # JobOutcomes

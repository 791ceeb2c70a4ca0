"""The request machine's shared state: its limits, its counters, and what is open.

``RequestMachine`` (``requests``) is a facade over parts that each own one thing and all
hold this one state object: ``Lanes`` (per servable version: the batcher, jobs queued and
in flight), ``PythonQueue`` (instances waiting for a Python step, tasks running),
``Replies`` (ending instances and requests), ``Progress`` (instances moving through their
steps), ``JobOutcomes`` (a job's stage results) and ``Admission`` (letting requests in).
"""

from __future__ import annotations

from shardserve_scheduler.core.batching import Member
from shardserve_scheduler.core.jobs import Counters, Job, LaneKey, RequestState, VersionStats


class MachineState:
    """Every open request and job of the scheduler, its limits, counters and statistics."""

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
        self._prefix = id_prefix
        self._next_id = 0

    def new_id(self, kind: str) -> str:
        self._next_id += 1
        return f"{self._prefix}-{kind}{self._next_id}"

    def stats_of(self, key: LaneKey) -> VersionStats:
        """The statistics of a servable version, made on first use."""
        return self.stats.setdefault(key, VersionStats())

    def open_for(self, servable: str, version: int) -> int:
        return sum(1 for s in self.requests.values() if s.call.lane_key == (servable, version))

    def alive(self, key: str, index: int, position: int) -> RequestState | None:
        """The request, if this instance is still open and at this step."""
        state = self.requests.get(key)
        if state is None:
            return None
        instance = state.instances[index]
        return state if instance.outcome is None and instance.step == position else None

    def live_members(self, job: Job) -> list[Member]:
        return [m for m in job.members if self.alive(*alive_key(m))]


def alive_key(member: Member) -> tuple[str, int, int]:
    """The (request key, instance index, step position) that ``MachineState.alive`` checks."""
    return member[0], member[1], member[3]

"""The requests the machine has let in and not yet answered, owned in one place.

``Admission`` opens a request and ``Replies`` closes it (with its one reply); every other
part asks: is this instance still open at this step (``alive``), which members of a job
still count (``live_members``), which requests a servable version has open.
"""

from __future__ import annotations

from shardserve_scheduler.core.batching import Member
from shardserve_scheduler.core.jobs import Call, InstanceState, Job, RequestState


class Ids:
    """Ids of requests, jobs and Python tasks, unique to one scheduler (its prefix)."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._next = 0

    def new(self, kind: str) -> str:
        self._next += 1
        return f"{self._prefix}-{kind}{self._next}"


class OpenRequests:
    """Every open request by key."""

    def __init__(self, ids: Ids) -> None:
        self._ids = ids
        self._open: dict[str, RequestState] = {}

    def open(self, call: Call, now: float, instances: list[InstanceState]) -> RequestState:
        state = RequestState(self._ids.new("r"), call, now, instances)
        self._open[state.key] = state
        return state

    def close(self, state: RequestState) -> None:
        del self._open[state.key]

    def is_open(self, state: RequestState) -> bool:
        return state.key in self._open

    def get(self, key: str) -> RequestState | None:
        return self._open.get(key)

    def all(self) -> list[RequestState]:
        """Every open request (a copy: the caller may close them as it goes)."""
        return list(self._open.values())

    def of_version(self, servable: str, version: int) -> list[RequestState]:
        return [s for s in self._open.values() if s.call.lane_key == (servable, version)]

    def __len__(self) -> int:
        return len(self._open)

    def alive(self, key: str, index: int, position: int) -> RequestState | None:
        """The request, if this instance is still open and at this step."""
        state = self._open.get(key)
        if state is None:
            return None
        instance = state.instances[index]
        return state if instance.outcome is None and instance.step == position else None

    def live_members(self, job: Job) -> list[Member]:
        return [m for m in job.members if self.alive(*alive_key(m))]

    def request_ids(self, job: Job) -> list[str]:
        """The ids of the open requests ``job`` serves, each once, in member order."""
        ids = (self._open[key].call.request.id for key, *_ in job.members if key in self._open)
        return list(dict.fromkeys(ids))


def alive_key(member: Member) -> tuple[str, int, int]:
    """The (request key, instance index, step position) that ``OpenRequests.alive`` checks."""
    return member[0], member[1], member[3]

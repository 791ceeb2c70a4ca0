"""The request/job state machine: events in, actions out; pure (``now`` is passed in).

Each instance of a request walks its method's steps: Python steps run as ``RunPython``
actions (the shell runs them in a worker pool and calls ``on_python_done``), the model
step as jobs, alone or batched with instances of other requests. A lost rank fails every
open instance of its group; the deadline and shutdown fail whole requests. Every request
gets exactly one Reply.

``RequestMachine`` is a facade over parts that each own one thing: ``OpenRequests`` (the
requests let in and not answered), ``Lanes`` (per servable version: the batcher, the jobs
queued and in flight), ``PythonQueue`` (instances waiting for a Python step, tasks running),
``Replies`` (ending instances and requests), ``Progress`` (instances moving through their
steps), ``JobOutcomes`` (a job's stage results) and ``Admission`` (letting requests in);
they ask each other through methods. Each event is handled by the parts that own what it
touches, then the machine *settles*: due batches leave,
Python tasks and queued jobs start, after the event's own publishes, so with several
stages jobs pipeline: job B's stage 0 goes out while job A is in stage 1.
"""

from __future__ import annotations

from collections.abc import Mapping

from shardserve.errors import ErrorCode
from shardserve.wire.protocol import StageResult
from shardserve_scheduler.core.actions import Action, bug_log, bug_message
from shardserve_scheduler.core.admission import Admission
from shardserve_scheduler.core.job_outcomes import JobOutcomes
from shardserve_scheduler.core.jobs import (
    Call,
    Counters,
    Job,
    RequestState,
    VersionStats,
    rank_error,
    stage_answered,
)
from shardserve_scheduler.core.lanes import Lanes
from shardserve_scheduler.core.open_requests import Ids, OpenRequests
from shardserve_scheduler.core.progress import Progress
from shardserve_scheduler.core.pystages import Outcome
from shardserve_scheduler.core.python_queue import PythonQueue
from shardserve_scheduler.core.replies import Replies
from shardserve_scheduler.core.request_limits import RequestLimits
from shardserve_scheduler.core.statistics import Statistics

__all__ = ["Call", "RequestMachine"]


class RequestMachine:
    """The events the shell feeds in; each returns the actions to take, in order."""

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
        self.limits = RequestLimits.of(
            result_to=result_to,
            max_inflight=max_inflight,
            queue_factor=queue_factor,
            max_batch_size=max_batch_size,
            batch_delay=batch_delay,
        )
        self.counters = Counters()
        self.statistics = Statistics()
        ids = Ids(id_prefix)
        self.requests = OpenRequests(ids)
        self.lanes = Lanes(self.limits, ids, self.requests, self.statistics)
        self.python = PythonQueue(self.limits, ids, self.requests)
        self.replies = Replies(self.counters, self.statistics, self.requests, self.lanes)
        self.progress = Progress(self.requests, self.lanes, self.replies, self.python)
        self.outcomes = JobOutcomes(
            self.counters, self.requests, self.lanes, self.replies, self.progress
        )
        self.admission = Admission(
            self.limits,
            self.counters,
            self.statistics,
            self.requests,
            self.lanes,
            self.replies,
            self.progress,
        )

    # ------------------------------------------------------------------ events

    def accept(self, call: Call, now: float) -> list[Action]:
        """Admit a resolved request (its instances start now, or it is refused), then
        start what it made ready."""
        return self._settled(self.admit(call, now), now)

    def admit(self, call: Call, now: float) -> list[Action]:
        """Admit a resolved request without starting queued work yet: the shell admits
        every request of a bundle this way and then calls ``settle`` once, so that the
        bundle's instances share jobs instead of the first leaving alone."""
        return self.admission.admit(call, now)

    def settle(self, now: float) -> list[Action]:
        """Start what admitted requests made ready (due batches, Python tasks, jobs)."""
        return self._settled([], now)

    def on_result(self, result: StageResult, now: float) -> list[Action]:
        """One rank's outcome of one stage of one job."""
        recorded = self.outcomes.record(result, now)
        if not isinstance(recorded, Job):
            return recorded  # late, stray or repeated: nothing changed
        job = recorded
        try:
            if result.error is not None:
                why = rank_error(job, result.rank, result.error)
                actions = self.outcomes.fail_job(job, *why, now)
            elif not stage_answered(job):
                return []
            else:
                actions = self.outcomes.stage_complete(job, now)
        except Exception as exc:  # a scheduler bug: the job's open requests fail loudly
            doing = f"handling a result of job {job.id}"
            return self._settled(self.outcomes.fail_job_after_bug(job, doing, exc, now), now)
        return self._settled(actions, now)

    def on_python_done(self, task_id: str, outcomes: list[Outcome], now: float) -> list[Action]:
        """A Python stage task finished: one outcome (outputs or error) per instance."""
        entry = self.python.finish(task_id)
        if entry is None:
            self.counters.late_python_results += 1
            return []
        position, members = entry
        actions: list[Action] = []
        for (key, index), outcome in zip(members, outcomes, strict=True):
            state = self.requests.alive(key, index, position)
            if state is None:
                continue
            try:
                actions += self.progress.python_outcome(state, index, position, outcome, now)
            except Exception as exc:  # a scheduler bug: this instance fails, the others go on
                doing = f"handling the result of Python task {task_id}"
                actions += self.replies.fail_instance_after_bug(state, index, doing, exc, now)
        return self._settled(actions, now)

    def on_rank_lost(self, servable: str, version: int, message: str, now: float) -> list[Action]:
        """A group lost ranks: every open instance of the group fails at once."""
        actions: list[Action] = []
        for state in self.requests.of_version(servable, version):
            try:
                actions += self.replies.fail_open_instances(
                    state, ErrorCode.RANK_LOST, message, now
                )
            except Exception as exc:  # a scheduler bug: still one outcome for each
                doing = "failing a request of a lost rank"
                actions += self.replies.abandon_after_bug(state, doing, exc)
        self.lanes.clear_batcher(servable, version)
        return self._settled(actions, now)

    def on_publish_failed(self, job_id: str, message: str, now: float) -> list[Action]:
        """A StageWork could not be handed to the broker: its instances fail UNAVAILABLE."""
        job = self.lanes.job(job_id)
        if job is None:
            return []
        why = f"could not send job {job_id} to its ranks: {message}"
        try:
            actions = self.outcomes.fail_job(job, ErrorCode.UNAVAILABLE, why, now)
        except Exception as exc:  # a scheduler bug: the job's open requests fail loudly
            doing = f"failing job {job_id} that could not be sent"
            actions = self.outcomes.fail_job_after_bug(job, doing, exc, now)
        return self._settled(actions, now)

    def tick(self, now: float) -> list[Action]:
        """End every request whose deadline has passed; flush batches that are due."""
        actions: list[Action] = []
        late = [s for s in self.requests.all() if s.call.request.deadline <= now]
        for state in late:
            try:
                message = _deadline_message(self.lanes, state, now)
                actions += self.replies.fail_request(state, ErrorCode.DEADLINE, message, now)
            except Exception as exc:  # a scheduler bug: still one outcome, and the others
                doing = "ending the request at its deadline"
                actions += self.replies.abandon_after_bug(state, doing, exc)
        return self._settled(actions, now)

    def shutdown(self, message: str, now: float) -> list[Action]:
        """Reply UNAVAILABLE to every request still open (the scheduler is stopping)."""
        actions: list[Action] = []
        for state in self.requests.all():
            actions += self.replies.fail_request(state, ErrorCode.UNAVAILABLE, message, now)
        return actions

    def _settled(self, actions: list[Action], now: float) -> list[Action]:
        """``actions``, then what settling starts (due batches, Python tasks, queued jobs).
        A bug while settling is logged and loses none of ``actions`` (replies among them);
        what it left unstarted is started by a later event (every tick settles), or ends
        at its deadline."""
        try:
            return actions + self.progress.settle(now)
        except Exception as exc:
            return [*actions, bug_log(bug_message("starting queued work", exc))]

    # ------------------------------------------------------------------ queries

    def inflight(self, servable: str, version: int) -> int:
        return self.lanes.inflight(servable, version)

    def queued(self, servable: str, version: int) -> int:
        return self.lanes.queued(servable, version)

    def version_stats(self, servable: str, version: int) -> VersionStats:
        return self.statistics.of((servable, version))

    def open_for(self, servable: str, version: int) -> int:
        return len(self.requests.of_version(servable, version))

    @property
    def open_requests(self) -> int:
        return len(self.requests)

    @property
    def jobs(self) -> Mapping[str, Job]:
        """Every open job, read-only."""
        return self.lanes.jobs

    def next_wakeup(self) -> float | None:
        """When the earliest open batch is due (the shell ticks then), or None."""
        return self.lanes.next_wakeup()

    def forget(self, servable: str, version: int) -> None:
        """Drop an unloaded version's lane and statistics (it has no open request)."""
        self.lanes.forget(servable, version)


def _deadline_message(lanes: Lanes, state: RequestState, now: float) -> str:
    waited_ms = (now - state.accepted_at) * 1000
    message = f"deadline exceeded after {waited_ms:.0f} ms in the scheduler"
    for job_id in sorted(state.jobs):
        job = lanes.job(job_id)
        if job is None:
            continue
        if job.stage < 0:
            return f"{message} (job {job.id} still queued behind other jobs)"
        silent = ", ".join(str(r) for r in job.silent_ranks())
        return (
            f"{message} (stage {job.stage} of {job.servable} v{job.group.version}: "
            f"no result yet from ranks {silent})"
        )
    waiting = [i.where for i in state.instances if i.outcome is None]
    return f"{message} (instance waiting: {waiting[0]})" if waiting else message

"""Lanes: per servable version, the batcher and the jobs queued (FIFO) and in flight.

A job enters its lane's queue (``queue_job``), starts while the version has room in flight
(``pump`` publishes its stage 0), moves from stage to stage (``publish``) and leaves
(``retire`` when it ends, ``drop_job`` when nobody needs it any more, which also cancels
it on its ranks). In-flight jobs are bounded per version (``max_inflight``). The lanes own
the open jobs: other parts look one up (``job``), they do not keep their own.
"""

from __future__ import annotations

from collections.abc import Mapping, ValuesView
from types import MappingProxyType

from shardserve.wire.protocol import JobCancel, StageWork, TensorMap
from shardserve.wire.tensors import digest_tensors
from shardserve_scheduler.core.actions import Action, Cancel, PublishStageWork, debug
from shardserve_scheduler.core.batching import Batcher, Member
from shardserve_scheduler.core.jobs import Call, Job, Lane, LaneKey, RequestState
from shardserve_scheduler.core.open_requests import Ids, OpenRequests, alive_key
from shardserve_scheduler.core.request_limits import RequestLimits
from shardserve_scheduler.core.statistics import Statistics
from shardserve_scheduler.core.timeline import Timeline


class Lanes:
    """The lanes of every servable version, and the jobs moving through them."""

    def __init__(
        self, limits: RequestLimits, ids: Ids, requests: OpenRequests, statistics: Statistics
    ) -> None:
        self._limits = limits
        self._ids = ids
        self._requests = requests
        self._statistics = statistics
        self._lanes: dict[LaneKey, Lane] = {}
        self._jobs: dict[str, Job] = {}

    # ------------------------------------------------------------------ the jobs

    def job(self, job_id: str) -> Job | None:
        """The open job of this id (None once it retired or was dropped)."""
        return self._jobs.get(job_id)

    @property
    def jobs(self) -> Mapping[str, Job]:
        """Every open job, read-only."""
        return MappingProxyType(self._jobs)

    # ------------------------------------------------------------------ the lanes

    def for_call(self, call: Call) -> Lane:
        """The lane of the call's servable version, made on first use."""
        lane = self._lanes.get(call.lane_key)
        if lane is None:
            group = call.group
            limit = group.max_batch_size or self._limits.max_batch_size
            batches = group.with_batch_dim and (group.max_batch_size > 0 or limit > 1)
            stacks = not group.with_batch_dim and limit > 1
            # Stacking never waits for company: instances leave at once while a stage is
            # free, and pile up into one job only while every stage is busy (Lane.hungry).
            delay = 0.0 if stacks else self._limits.batch_delay
            batcher = Batcher(limit, delay) if batches or stacks else None
            lane = Lane(group, batcher, call.method.no_batch_inputs, stacking=stacks)
            self._lanes[call.lane_key] = lane
        return lane

    def all(self) -> ValuesView[Lane]:
        return self._lanes.values()

    def inflight(self, servable: str, version: int) -> int:
        lane = self._lanes.get((servable, version))
        return len(lane.inflight) if lane else 0

    def queued(self, servable: str, version: int) -> int:
        lane = self._lanes.get((servable, version))
        return lane.waiting if lane else 0

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

    def clear_batcher(self, servable: str, version: int) -> None:
        """Forget the pieces being batched for a version (their instances have ended)."""
        lane = self._lanes.get((servable, version))
        if lane and lane.batcher is not None:
            lane.batcher.clear()

    def forget(self, servable: str, version: int) -> None:
        """Drop an unloaded version's lane and statistics (it has no open request)."""
        self._lanes.pop((servable, version), None)
        self._statistics.forget((servable, version))

    # ------------------------------------------------------------------ jobs entering

    def queue_job(
        self,
        lane: Lane,
        members: list[tuple[Member, TensorMap]],
        ranges: tuple[tuple[int, int], ...] | None,
        now: float,
        stacked: int = 0,
    ) -> None:
        states = [self._open(m[0]) for m, _ in members]
        job = Job(
            self._ids.new("j"),
            lane.group,
            tuple(m for m, _ in members),
            ranges,
            members[0][1],
            max(s.call.request.deadline for s in states),
            Timeline(min(s.accepted_at for s in states)),
            stacked=stacked,
        )
        job.timeline.mark(now, f"queued ({len(members)} member(s))")
        self._jobs[job.id] = job
        for state in states:
            state.jobs.add(job.id)
        lane.queued.append(job)
        self._statistics.batch(job.lane_key, len(members))

    def pump(self, lane: Lane, now: float) -> list[Action]:
        """Publish stage 0 of queued jobs while the version has room in flight."""
        actions: list[Action] = []
        while lane.queued and len(lane.inflight) < self._limits.max_inflight:
            job = lane.queued.popleft()
            if job.id not in self._jobs:
                continue
            if not self._requests.live_members(job):
                del self._jobs[job.id]  # every request it served already ended
                continue
            lane.inflight.add(job.id)
            for key, index, _, _ in job.members:
                if (state := self._requests.get(key)) is not None:
                    state.instances[index].where = "in the model"
            actions.append(self.publish(job, 0, job.inputs, digest_tensors(job.inputs), now))
        return actions

    def publish(
        self, job: Job, stage: int, inputs: TensorMap, digest: str, now: float
    ) -> PublishStageWork:
        job.stage = stage
        job.results = {}
        job.inputs = {}  # the inputs live in the message now; keep no second copy
        job.timeline.mark(now, f"s{stage} publish")
        work = StageWork(
            job=job.id,
            servable=job.servable,
            version=job.group.version,
            stage=stage,
            inputs=inputs,
            digest=digest,
            deadline=job.deadline,
            result_to=self._limits.result_to,
            requests=tuple(self._requests.request_ids(job)),
            stacked=job.stacked,
        )
        return PublishStageWork(work)

    # ------------------------------------------------------------------ jobs leaving

    def retire(self, job: Job, now: float) -> list[Action]:
        """Forget a job (its lane slot frees); log its timeline."""
        del self._jobs[job.id]
        lane = self._lanes.get(job.lane_key)
        if lane:
            lane.inflight.discard(job.id)
        for key, *_ in job.members:
            if (state := self._requests.get(key)) is not None:
                state.jobs.discard(job.id)
        request_id = next(iter(self._requests.request_ids(job)), "-")
        return [debug(f"job {job.id} timeline: {job.timeline.render(now)}", request_id)]

    def drop_job(self, job: Job, reason: str, now: float) -> list[Action]:
        published = job.stage >= 0
        actions = self.retire(job, now)
        if published:
            cancel = JobCancel(
                job=job.id, servable=job.servable, version=job.group.version, reason=reason
            )
            actions.append(Cancel(cancel))
        return actions

    def prune(self, state: RequestState, now: float) -> list[Action]:
        """Drop the jobs of this request that serve no open instance any more."""
        actions: list[Action] = []
        for job_id in sorted(state.jobs):
            job = self._jobs.get(job_id)
            if job is None:
                state.jobs.discard(job_id)
            elif not self._requests.live_members(job):
                actions += self.drop_job(job, "every request it served has ended", now)
            elif not self._serves(job, state):
                state.jobs.discard(job_id)
        return actions

    def _serves(self, job: Job, state: RequestState) -> bool:
        """Whether ``job`` still serves an open instance of this request."""
        alive = self._requests.alive
        return any(m[0] == state.key and alive(*alive_key(m)) for m in job.members)

    def _open(self, key: str) -> RequestState:
        state = self._requests.get(key)
        if state is None:
            raise KeyError(f"a job for request {key}, which is not open")
        return state

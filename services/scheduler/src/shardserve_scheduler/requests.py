"""The request/job state machine: events in, actions out; pure (``now`` is passed in).

A *request* is one InferRequest; a *job* is one model run. Today a job carries one
instance of one request (``with_batch_dim=False``, or each instance separately); the
split keeps room for batching several instances of several requests into one job.

Per job and stage, every rank of the stage must answer: all digests equal -> the next
stage (inputs = the leader's outputs) or the end; a rank error, a digest disagreement,
the deadline, or a lost rank ends the job's request with an error and cancels the job.
Every request gets exactly one Reply, whatever happens.

In-flight jobs are bounded per servable (``max_inflight``); beyond, jobs wait in a FIFO
queue of ``queue_factor * max_inflight``; beyond that, the request is refused OVERLOADED.
A job's stage 0 is published as soon as it is admitted, so with several stages jobs
pipeline naturally (job B in stage 0 while job A is in stage 1).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from shardserve.errors import ErrorCode
from shardserve.protocol import (
    InferReply,
    InstanceResult,
    JobCancel,
    StageResult,
    StageWork,
    TensorMap,
)
from shardserve.tensors import digest_tensors
from shardserve_scheduler.actions import (
    Action,
    Cancel,
    Log,
    PublishStageWork,
    Reply,
    debug,
    error_reply,
)
from shardserve_scheduler.jobs import (
    Call,
    Counters,
    Job,
    Lane,
    RequestState,
    digest_disagreement,
    rank_error,
)
from shardserve_scheduler.timeline import Timeline

__all__ = ["Call", "RequestMachine"]

_T = TypeVar("_T", Job, RequestState)


class RequestMachine:
    """Owns every open request and job of the scheduler."""

    def __init__(
        self, *, result_to: str, id_prefix: str, max_inflight: int = 64, queue_factor: int = 10
    ) -> None:
        self.result_to = result_to
        self.max_inflight = max(1, max_inflight)
        self.max_queued = queue_factor * self.max_inflight
        self.counters = Counters()
        self.requests: dict[str, RequestState] = {}
        self.jobs: dict[str, Job] = {}
        self._lanes: dict[str, Lane] = {}
        self._prefix = id_prefix
        self._next_id = 0
        self._pump_paused = False

    # ------------------------------------------------------------------ queries

    def inflight(self, servable: str, version: int) -> int:
        return sum(
            1
            for j in self.jobs.values()
            if j.servable == servable and j.group.version == version and j.stage >= 0
        )

    @property
    def open_requests(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------ events

    def accept(self, call: Call, now: float) -> list[Action]:
        """Admit a resolved request: its jobs start now, wait in the queue, or it is refused."""
        request = call.request
        if request.deadline <= now:
            return [
                self._count_reply(
                    error_reply(
                        request,
                        call.reply_to,
                        call.correlation_id,
                        ErrorCode.DEADLINE,
                        "deadline already passed when the scheduler received the request",
                        version=call.group.version,
                    )
                )
            ]
        lane = self._lanes.setdefault(request.servable, Lane())
        room = self.max_inflight - len(lane.inflight) + self.max_queued - len(lane.queued)
        if len(request.instances) > room:
            self.counters.overloaded += 1
            message = (
                f"servable {request.servable} is overloaded: {len(lane.inflight)} jobs in "
                f"flight, {len(lane.queued)} queued"
            )
            reply = error_reply(
                request,
                call.reply_to,
                call.correlation_id,
                ErrorCode.OVERLOADED,
                message,
                version=call.group.version,
            )
            return [self._count_reply(reply)]
        state = self._open_request(call, now)
        for index, instance in enumerate(request.instances):
            lane.queued.append(self._new_job(state, index, call.method.model_inputs(instance), now))
        return self._pump(lane, now)

    def on_result(self, result: StageResult, now: float) -> list[Action]:
        """One rank's outcome of one stage of one job."""
        job = self.jobs.get(result.job)
        if job is None or result.stage != job.stage:
            self.counters.late_results += 1
            return []
        if result.rank not in job.stage_ranks():
            self.counters.stray_results += 1
            return [
                Log(
                    logging.WARNING,
                    f"job {job.id}: rank {result.rank} is not in stage {job.stage}; result ignored",
                )
            ]
        if result.rank in job.results:
            self.counters.duplicate_results += 1
            return []
        job.results[result.rank] = result
        job.timeline.mark(now, f"s{job.stage} r{result.rank}")
        if result.error is not None:
            return self._fail_job(job, *rank_error(job, result.rank, result.error), now)
        if len(job.results) < len(job.stage_ranks()):
            return []
        return self._stage_complete(job, now)

    def on_rank_lost(self, servable: str, version: int, message: str, now: float) -> list[Action]:
        """A group lost ranks: each of its jobs (in flight or queued) fails at once."""
        doomed = [
            j for j in self.jobs.values() if (j.servable, j.group.version) == (servable, version)
        ]
        return self._in_bulk(
            lambda job: self._fail_job(job, ErrorCode.RANK_LOST, message, now), doomed, now
        )

    def on_publish_failed(self, job_id: str, message: str, now: float) -> list[Action]:
        """A StageWork could not be handed to the broker: its request fails UNAVAILABLE."""
        job = self.jobs.get(job_id)
        if job is None:
            return []
        return self._fail_job(
            job, ErrorCode.UNAVAILABLE, f"could not send job {job_id} to its ranks: {message}", now
        )

    def tick(self, now: float) -> list[Action]:
        """End every request whose deadline has passed."""
        expired = [s for s in self.requests.values() if s.call.request.deadline <= now]
        return self._in_bulk(
            lambda state: self._fail_request(
                state, ErrorCode.DEADLINE, _deadline_message(self, state, now), now
            ),
            expired,
            now,
        )

    def shutdown(self, message: str, now: float) -> list[Action]:
        """Reply UNAVAILABLE to every request still open (the scheduler is stopping)."""
        return self._in_bulk(
            lambda state: self._fail_request(state, ErrorCode.UNAVAILABLE, message, now),
            list(self.requests.values()),
            now,
        )

    # ------------------------------------------------------------------ internals

    def _in_bulk(
        self, fail: Callable[[_T], list[Action]], items: list[_T], now: float
    ) -> list[Action]:
        """Fail many items; queued jobs start only afterwards, so none of the doomed ones
        is published just to be cancelled."""
        actions: list[Action] = []
        self._pump_paused = True
        try:
            for item in items:
                if not _ended(self, item):
                    actions += fail(item)
        finally:
            self._pump_paused = False
        for lane in self._lanes.values():
            actions += self._pump(lane, now)
        return actions

    def _new_id(self, kind: str) -> str:
        self._next_id += 1
        return f"{self._prefix}-{kind}{self._next_id}"

    def _open_request(self, call: Call, now: float) -> RequestState:
        self.counters.accepted += 1
        state = RequestState(self._new_id("r"), call, now, [None] * len(call.request.instances))
        self.requests[state.key] = state
        return state

    def _new_job(self, state: RequestState, index: int, inputs: TensorMap, now: float) -> Job:
        job = Job(
            self._new_id("j"),
            state.call.group,
            ((state.key, index),),
            inputs,
            state.call.request.deadline,
            Timeline(state.accepted_at),
        )
        job.timeline.mark(now, "queued")
        self.jobs[job.id] = job
        state.jobs.add(job.id)
        return job

    def _pump(self, lane: Lane, now: float) -> list[Action]:
        """Publish stage 0 of queued jobs while the servable has room in flight."""
        actions: list[Action] = []
        while not self._pump_paused and lane.queued and len(lane.inflight) < self.max_inflight:
            job = lane.queued.popleft()
            if job.id not in self.jobs:
                continue  # its request already ended while it waited
            lane.inflight.add(job.id)
            actions.append(self._publish(job, 0, job.inputs, digest_tensors(job.inputs), now))
        return actions

    def _publish(
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
            result_to=self.result_to,
            requests=tuple(self.requests[key].call.request.id for key, _ in job.members),
        )
        return PublishStageWork(work)

    def _stage_complete(self, job: Job, now: float) -> list[Action]:
        disagreement = digest_disagreement(job)
        if disagreement:
            return self._fail_job(job, ErrorCode.INTERNAL, disagreement, now)
        leader = job.group.leader_of(job.stage)
        outputs = job.results[leader].outputs
        if outputs is None:
            return self._fail_job(
                job,
                ErrorCode.INTERNAL,
                f"stage {job.stage} leader rank "
                f"{leader} of {job.servable} v{job.group.version} sent no "
                "outputs",
                now,
            )
        digest = digest_tensors(outputs)
        if digest != job.results[leader].digest:
            return self._fail_job(
                job,
                ErrorCode.INTERNAL,
                f"stage {job.stage} outputs of rank "
                f"{leader} do not match the digest the ranks agreed on",
                now,
            )
        if job.stage + 1 < job.group.stage_size:
            return [self._publish(job, job.stage + 1, outputs, digest, now)]
        return self._finish_job(job, outputs, now)

    def _finish_job(self, job: Job, outputs: TensorMap, now: float) -> list[Action]:
        actions = self._retire(job, now)
        for key, index in job.members:
            state = self.requests[key]
            state.jobs.discard(job.id)
            state.results[index] = state.call.method.method_outputs(
                outputs, state.call.request.outputs
            )
            if not state.jobs:
                actions += self._succeed(state, now)
        return actions + self._pump(self._lanes[job.servable], now)

    def _retire(self, job: Job, now: float) -> list[Action]:
        """Forget a job (its lane slot frees); log its timeline."""
        del self.jobs[job.id]
        self._lanes[job.servable].inflight.discard(job.id)
        request_id = self._member_request_id(job)
        return [debug(f"job {job.id} timeline: {job.timeline.render(now)}", request_id)]

    def _member_request_id(self, job: Job) -> str:
        key = job.members[0][0]
        state = self.requests.get(key)
        return state.call.request.id if state else "-"

    def _succeed(self, state: RequestState, now: float) -> list[Action]:
        call = state.call
        instances = tuple(InstanceResult(outputs=r) for r in state.results)
        reply = InferReply(
            id=call.request.id,
            servable=call.group.servable,
            version=call.group.version,
            method=call.request.method,
            instances=instances,
        )
        self._close(state)
        self.counters.succeeded += 1
        return [self._count_reply(Reply(call.reply_to, call.correlation_id, reply))]

    def _fail_job(self, job: Job, code: ErrorCode, message: str, now: float) -> list[Action]:
        """A job ends in error: cancel it on its ranks and fail every request it serves."""
        actions: list[Action] = []
        for key, _ in job.members:
            state = self.requests.get(key)
            if state is not None:
                actions += self._fail_request(state, code, message, now)
        if job.id in self.jobs:  # a job with no open request left (cannot happen today)
            actions += self._drop_job(job, message, now)
        return actions

    def _fail_request(
        self, state: RequestState, code: ErrorCode, message: str, now: float
    ) -> list[Action]:
        """Reply one error to a request and drop every job it still has."""
        call = state.call
        reply = error_reply(
            call.request,
            call.reply_to,
            call.correlation_id,
            code,
            message,
            version=call.group.version,
        )
        actions: list[Action] = [self._count_reply(reply)]
        level = (
            logging.INFO if code in (ErrorCode.DEADLINE, ErrorCode.UNAVAILABLE) else logging.WARNING
        )
        actions.append(Log(level, f"request failed ({code.value}): {message}", call.request.id))
        lanes_touched: set[str] = set()
        for job_id in sorted(state.jobs):
            job = self.jobs.get(job_id)
            if job is not None:
                actions += self._drop_job(job, message, now)
                lanes_touched.add(job.servable)
        self._close(state)
        self.counters.failed += 1
        for servable in sorted(lanes_touched):
            actions += self._pump(self._lanes[servable], now)
        return actions

    def _drop_job(self, job: Job, reason: str, now: float) -> list[Action]:
        actions = self._retire(job, now)
        if job.stage >= 0:
            cancel = JobCancel(
                job=job.id, servable=job.servable, version=job.group.version, reason=reason
            )
            actions.append(Cancel(cancel))
        return actions

    def _close(self, state: RequestState) -> None:
        state.done = True
        state.jobs.clear()
        del self.requests[state.key]

    def _count_reply(self, reply: Reply) -> Reply:
        self.counters.replied += 1
        return reply


def _ended(machine: RequestMachine, item: Job | RequestState) -> bool:
    """Whether an earlier failure in the same bulk operation already ended this item."""
    if isinstance(item, Job):
        return item.id not in machine.jobs
    return item.key not in machine.requests


def _deadline_message(machine: RequestMachine, state: RequestState, now: float) -> str:
    waited_ms = (now - state.accepted_at) * 1000
    message = f"deadline exceeded after {waited_ms:.0f} ms in the scheduler"
    for job_id in sorted(state.jobs):
        job = machine.jobs.get(job_id)
        if job is None:
            continue
        if job.stage < 0:
            return f"{message} (job {job.id} still queued behind other jobs)"
        silent = ", ".join(str(r) for r in job.silent_ranks())
        return (
            f"{message} (stage {job.stage} of {job.servable} v{job.group.version}: "
            f"no result yet from ranks {silent})"
        )
    return message

"""The request/job state machine: events in, actions out; pure (``now`` is passed in).

Each instance of a request walks its method's steps. A Python step becomes a ``RunPython``
action (the shell runs it in a worker pool and calls ``on_python_done``); a batched
Python step (batch_size 0 or k) gets a list of the instances waiting for it after the
current event, at most k (0: the maximum batch size) per call. The model step makes
jobs: one per instance (``with_batch_dim=False``, or ``max_batch_size`` 1), or batches
of instances of several requests (see ``batching``).

Per job and stage, every rank of the stage must answer: all digests equal -> the next
stage (inputs = the leader's outputs) or the job's end; a rank error or a digest
disagreement fails the job's instances. A lost rank fails every open instance of its
group; the deadline and shutdown fail whole requests. Each instance has its own outcome
(InstanceResult); when every instance failed with the same error the reply carries that
one error instead, as MindSpore does. Every request gets exactly one Reply.

In-flight jobs are bounded per servable version (``max_inflight``); beyond, jobs wait in
a FIFO of ``queue_factor * max_inflight`` (pieces being batched count as waiting);
beyond that, the request is refused OVERLOADED. Queued jobs start (stage 0 published)
at the end of every event, after the event's own publishes, so with several stages jobs
pipeline: job B's stage 0 goes out while job A is in stage 1, all from one channel.
"""

from __future__ import annotations

import logging
import traceback

from shardserve.errors import ErrorCode
from shardserve.protocol import ErrorInfo, StageResult
from shardserve_scheduler.actions import Action, Log, Reply, bug_message, error_reply
from shardserve_scheduler.jobs import (
    Call,
    InstanceState,
    Job,
    RequestState,
    VersionStats,
    rank_error,
)
from shardserve_scheduler.progress import Progress
from shardserve_scheduler.pystages import Outcome

__all__ = ["Call", "RequestMachine"]


class RequestMachine(Progress):
    """The events the shell feeds in; each returns the actions to take, in order."""

    # ------------------------------------------------------------------ events

    def accept(self, call: Call, now: float) -> list[Action]:
        """Admit a resolved request: its instances start now, or it is refused."""
        request = call.request
        stats = self.stats.setdefault(call.lane_key, VersionStats())
        stats.requests_total += 1
        refusal = self._refusal(call, now)
        if refusal is not None:
            stats.errors_total += 1
            return [self._count_reply(refusal)]
        self.counters.accepted += 1
        instances = [InstanceState(call.method.start_env(i)) for i in request.instances]
        state = RequestState(self._new_id("r"), call, now, instances)
        self.requests[state.key] = state
        actions: list[Action] = []
        try:
            for index in range(len(instances)):
                actions += self._advance(state, index, now)
            return actions + self._settle(now)
        except Exception as exc:  # a scheduler bug: this request fails loudly, others go on
            return actions + self._fail_after_bug(state, exc, now)

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
        try:
            if result.error is not None:
                actions = self._fail_job(job, *rank_error(job, result.rank, result.error), now)
            elif len(job.results) < len(job.stage_ranks()):
                return []
            else:
                actions = self._stage_complete(job, now)
            return actions + self._settle(now)
        except Exception as exc:  # a scheduler bug: the job's open requests fail loudly
            return self._fail_job_after_bug(job, exc, now)

    def on_python_done(self, task_id: str, outcomes: list[Outcome], now: float) -> list[Action]:
        """A Python stage task finished: one outcome (outputs or error) per instance."""
        entry = self._py_tasks.pop(task_id, None)
        if entry is None:
            self.counters.late_python_results += 1
            return []
        (_, _, position), members = entry
        actions: list[Action] = []
        for (key, index), outcome in zip(members, outcomes, strict=True):
            state = self._alive(key, index, position)
            if state is None:
                continue
            if isinstance(outcome, ErrorInfo):
                actions += self._fail_instance(state, index, outcome.code, outcome.message, now)
                continue
            instance = state.instances[index]
            step = state.call.method.steps[position]
            for j, tensor in enumerate(outcome):
                instance.env[(step.index, j)] = tensor
            instance.step += 1
            actions += self._advance(state, index, now)
        return actions + self._settle(now)

    def on_rank_lost(self, servable: str, version: int, message: str, now: float) -> list[Action]:
        """A group lost ranks: every open instance of the group fails at once."""
        actions: list[Action] = []
        doomed = [s for s in self.requests.values() if s.call.lane_key == (servable, version)]
        for state in doomed:
            for index, instance in enumerate(state.instances):
                if instance.outcome is None and state.key in self.requests:
                    actions += self._fail_instance(state, index, ErrorCode.RANK_LOST, message, now)
        lane = self._lanes.get((servable, version))
        if lane and lane.batcher is not None:
            lane.batcher.clear()
        return actions + self._settle(now)

    def on_publish_failed(self, job_id: str, message: str, now: float) -> list[Action]:
        """A StageWork could not be handed to the broker: its instances fail UNAVAILABLE."""
        job = self.jobs.get(job_id)
        if job is None:
            return []
        why = f"could not send job {job_id} to its ranks: {message}"
        return self._fail_job(job, ErrorCode.UNAVAILABLE, why, now) + self._settle(now)

    def tick(self, now: float) -> list[Action]:
        """End every request whose deadline has passed; flush batches that are due."""
        actions: list[Action] = []
        for state in [s for s in self.requests.values() if s.call.request.deadline <= now]:
            message = _deadline_message(self, state, now)
            actions += self._fail_request(state, ErrorCode.DEADLINE, message, now)
        return actions + self._settle(now)

    def shutdown(self, message: str, now: float) -> list[Action]:
        """Reply UNAVAILABLE to every request still open (the scheduler is stopping)."""
        actions: list[Action] = []
        for state in list(self.requests.values()):
            actions += self._fail_request(state, ErrorCode.UNAVAILABLE, message, now)
        return actions

    def _fail_after_bug(self, state: RequestState, exc: Exception, now: float) -> list[Action]:
        """The request whose admission raised gets an INTERNAL error now instead of waiting
        for its deadline (and the rest of its bundle is still admitted); the traceback is
        logged."""
        message = bug_message("while admitting the request", exc)
        log = _bug_log(message, state.call.request.id)
        if state.key not in self.requests:  # it already had its one outcome
            return [log]
        return [log, *self._fail_request(state, ErrorCode.INTERNAL, message, now)]

    def _fail_job_after_bug(self, job: Job, exc: Exception, now: float) -> list[Action]:
        """Handling a result of ``job`` raised: every instance it still serves gets an
        INTERNAL error now instead of waiting for its deadline; the traceback is logged."""
        message = bug_message(f"handling a result of job {job.id}", exc)
        return [_bug_log(message), *self._fail_job(job, ErrorCode.INTERNAL, message, now)]

    # ------------------------------------------------------------------ admission

    def _refusal(self, call: Call, now: float) -> Reply | None:
        request = call.request
        code, message = None, ""
        if request.deadline <= now:
            code = ErrorCode.DEADLINE
            message = "deadline already passed when the scheduler received the request"
        else:
            lane = self._lane(call)
            room = self.max_inflight + self.max_queued - len(lane.inflight) - lane.waiting
            if len(request.instances) > room:
                self.counters.overloaded += 1
                code = ErrorCode.OVERLOADED
                message = (
                    f"servable {request.servable} is overloaded: {len(lane.inflight)} jobs in "
                    f"flight, {lane.waiting} queued"
                )
        if code is None:
            return None
        return error_reply(
            request, call.reply_to, call.correlation_id, code, message, version=call.group.version
        )


def _bug_log(message: str, request_id: str = "-") -> Log:
    """The error log of a bug the core caught: its message and the traceback (called while
    the exception is being handled)."""
    return Log(logging.ERROR, f"{message}\n{traceback.format_exc()}", request_id)


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
    waiting = [i.where for i in state.instances if i.outcome is None]
    return f"{message} (instance waiting: {waiting[0]})" if waiting else message

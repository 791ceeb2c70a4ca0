"""The request/job state machine: events in, actions out; pure (``now`` is passed in).

Each instance of a request walks its method's steps. A Python step becomes a ``RunPython``
action (the shell runs it in a worker pool and calls ``on_python_done``); a batched
Python step (batch_size 0 or k) gets a list of the instances waiting for it after the
current event, at most k (0: the maximum batch size) per call. The model step makes
jobs: one per instance (``with_batch_dim=False``, or ``max_batch_size`` 1), or batches
of instances of several requests (see ``batching``).

Per job and stage, every rank of the stage must answer (only the leader, where the
stage's outputs are combined at the leader: the others answer only with an error): all
digests equal -> the next stage (inputs = the leader's outputs) or the job's end; a rank
error or a digest disagreement fails the job's instances. A lost rank fails every open
instance of its group; the deadline and shutdown fail whole requests. Each instance has
its own outcome (InstanceResult); when every instance failed with the same error the
reply carries that one error instead, as MindSpore does. Every request gets exactly one
Reply.

In-flight jobs are bounded per servable version (``max_inflight``); beyond, jobs wait in
a FIFO of ``queue_factor * max_inflight`` (pieces being batched count as waiting);
beyond that, the request is refused OVERLOADED. Queued jobs start (stage 0 published)
at the end of every event, after the event's own publishes, so with several stages jobs
pipeline: job B's stage 0 goes out while job A is in stage 1, all from one channel.
"""

from __future__ import annotations

import logging

from shardserve.errors import ErrorCode
from shardserve.wire.protocol import ErrorInfo, StageResult
from shardserve_scheduler.core.actions import (
    Action,
    Log,
    Reply,
    bug_log,
    bug_message,
    error_reply,
)
from shardserve_scheduler.core.jobs import (
    Call,
    InstanceState,
    Job,
    Lane,
    RequestState,
    VersionStats,
    rank_error,
    stage_answered,
)
from shardserve_scheduler.core.progress import Progress
from shardserve_scheduler.core.pystages import Outcome

__all__ = ["Call", "RequestMachine"]


class RequestMachine(Progress):
    """The events the shell feeds in; each returns the actions to take, in order."""

    # ------------------------------------------------------------------ events

    def accept(self, call: Call, now: float) -> list[Action]:
        """Admit a resolved request (its instances start now, or it is refused), then
        start what it made ready."""
        return self._settled(self.admit(call, now), now)

    def admit(self, call: Call, now: float) -> list[Action]:
        """Admit a resolved request without starting queued work yet: the shell admits
        every request of a bundle this way and then calls ``settle`` once, so that the
        bundle's instances share jobs instead of the first leaving alone."""
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
            return actions
        except Exception as exc:  # a scheduler bug: this request fails loudly, others go on
            return actions + self._fail_after_bug(state, exc, now)

    def settle(self, now: float) -> list[Action]:
        """Start what admitted requests made ready (due batches, Python tasks, jobs)."""
        return self._settled([], now)

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
            elif not stage_answered(job):
                return []
            else:
                actions = self._stage_complete(job, now)
        except Exception as exc:  # a scheduler bug: the job's open requests fail loudly
            doing = f"handling a result of job {job.id}"
            return self._settled(self._fail_job_after_bug(job, doing, exc, now), now)
        return self._settled(actions, now)

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
            try:
                actions += self._python_outcome(state, index, position, outcome, now)
            except Exception as exc:  # a scheduler bug: this instance fails, the others go on
                doing = f"handling the result of Python task {task_id}"
                actions += self._fail_instance_after_bug(state, index, doing, exc, now)
        return self._settled(actions, now)

    def _python_outcome(
        self, state: RequestState, index: int, position: int, outcome: Outcome, now: float
    ) -> list[Action]:
        if isinstance(outcome, ErrorInfo):
            return self._fail_instance(state, index, outcome.code, outcome.message, now)
        instance = state.instances[index]
        step = state.call.method.steps[position]
        for j, tensor in enumerate(outcome):
            instance.env[(step.index, j)] = tensor
        instance.step += 1
        return self._advance(state, index, now)

    def on_rank_lost(self, servable: str, version: int, message: str, now: float) -> list[Action]:
        """A group lost ranks: every open instance of the group fails at once."""
        actions: list[Action] = []
        doomed = [s for s in self.requests.values() if s.call.lane_key == (servable, version)]
        for state in doomed:
            try:
                actions += self._fail_open_instances(state, ErrorCode.RANK_LOST, message, now)
            except Exception as exc:  # a scheduler bug: still one outcome for each
                actions += self._abandon_after_bug(state, "failing a request of a lost rank", exc)
        lane = self._lanes.get((servable, version))
        if lane and lane.batcher is not None:
            lane.batcher.clear()
        return self._settled(actions, now)

    def _fail_open_instances(
        self, state: RequestState, code: ErrorCode, message: str, now: float
    ) -> list[Action]:
        """Fail every instance of ``state`` without an outcome (finished ones keep theirs)."""
        actions: list[Action] = []
        for index, instance in enumerate(state.instances):
            if instance.outcome is None and state.key in self.requests:
                actions += self._fail_instance(state, index, code, message, now)
        return actions

    def on_publish_failed(self, job_id: str, message: str, now: float) -> list[Action]:
        """A StageWork could not be handed to the broker: its instances fail UNAVAILABLE."""
        job = self.jobs.get(job_id)
        if job is None:
            return []
        why = f"could not send job {job_id} to its ranks: {message}"
        try:
            actions = self._fail_job(job, ErrorCode.UNAVAILABLE, why, now)
        except Exception as exc:  # a scheduler bug: the job's open requests fail loudly
            doing = f"failing job {job_id} that could not be sent"
            actions = self._fail_job_after_bug(job, doing, exc, now)
        return self._settled(actions, now)

    def tick(self, now: float) -> list[Action]:
        """End every request whose deadline has passed; flush batches that are due."""
        actions: list[Action] = []
        for state in [s for s in self.requests.values() if s.call.request.deadline <= now]:
            try:
                message = _deadline_message(self, state, now)
                actions += self._fail_request(state, ErrorCode.DEADLINE, message, now)
            except Exception as exc:  # a scheduler bug: still one outcome, and the others
                doing = "ending the request at its deadline"
                actions += self._abandon_after_bug(state, doing, exc)
        return self._settled(actions, now)

    def shutdown(self, message: str, now: float) -> list[Action]:
        """Reply UNAVAILABLE to every request still open (the scheduler is stopping)."""
        actions: list[Action] = []
        for state in list(self.requests.values()):
            actions += self._fail_request(state, ErrorCode.UNAVAILABLE, message, now)
        return actions

    def _settled(self, actions: list[Action], now: float) -> list[Action]:
        """``actions``, then what settling starts (due batches, Python tasks, queued jobs).
        A bug while settling is logged and loses none of ``actions`` (replies among them);
        what it left unstarted is started by a later event (every tick settles), or ends
        at its deadline."""
        try:
            return actions + self._settle(now)
        except Exception as exc:
            return [*actions, bug_log(bug_message("starting queued work", exc))]

    def _fail_after_bug(self, state: RequestState, exc: Exception, now: float) -> list[Action]:
        """The request whose admission raised gets an INTERNAL error now instead of waiting
        for its deadline (and the rest of its bundle is still admitted); the traceback is
        logged."""
        message = bug_message("while admitting the request", exc)
        log = bug_log(message, state.call.request.id)
        if state.key not in self.requests:  # it already had its one outcome
            return [log]
        try:
            return [log, *self._fail_request(state, ErrorCode.INTERNAL, message, now)]
        except Exception:
            return [log, *self._abandon(state, message)]

    def _fail_job_after_bug(self, job: Job, doing: str, exc: Exception, now: float) -> list[Action]:
        """Handling ``job`` raised: every instance it still serves gets an INTERNAL error
        now instead of waiting for its deadline; the traceback is logged."""
        message = bug_message(doing, exc)
        try:
            return [bug_log(message), *self._fail_job(job, ErrorCode.INTERNAL, message, now)]
        except Exception:  # failing it the regular way raised too
            actions: list[Action] = [bug_log(message)]
            for key in dict.fromkeys(k for k, *_ in job.members):
                state = self.requests.get(key)
                if state is not None:
                    actions += self._abandon(state, message)
            return actions

    def _abandon_after_bug(self, state: RequestState, doing: str, exc: Exception) -> list[Action]:
        """Ending ``state`` the regular way raised: it is answered INTERNAL all the same."""
        message = bug_message(doing, exc)
        return [bug_log(message, state.call.request.id), *self._abandon(state, message)]

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
                message = self._overload_message(call, lane)
        if code is None:
            return None
        return error_reply(
            request, call.reply_to, call.correlation_id, code, message, version=call.group.version
        )

    def _overload_message(self, call: Call, lane: Lane) -> str:
        # Instances being batched take a place each (each could end up a job of its own),
        # so a batching servable can be full with few jobs: the message says which.
        batching = len(lane.batcher) if lane.batcher is not None else 0
        held = f", {batching} instance(s) being batched" if batching else ""
        return (
            f"servable {call.request.servable} is overloaded: {len(lane.inflight)} jobs in "
            f"flight, {len(lane.queued)} queued{held} (at most {self.max_inflight} in flight "
            f"and {self.max_queued} waiting: --max-inflight {self.max_inflight})"
        )


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

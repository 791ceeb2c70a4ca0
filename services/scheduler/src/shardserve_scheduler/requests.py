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

from shardserve.errors import ErrorCode, InferenceError
from shardserve.protocol import (
    ErrorInfo,
    InferReply,
    InstanceResult,
    JobCancel,
    StageResult,
    StageWork,
    TensorMap,
)
from shardserve.signature import check_instance
from shardserve.tensors import Tensor, digest_tensors
from shardserve_scheduler import batching
from shardserve_scheduler.actions import (
    Action,
    Cancel,
    Log,
    PublishStageWork,
    Reply,
    RunPython,
    debug,
    error_reply,
)
from shardserve_scheduler.batching import Batcher, Member, Piece
from shardserve_scheduler.jobs import (
    Call,
    Counters,
    InstanceState,
    Job,
    Lane,
    LaneKey,
    RequestState,
    VersionStats,
    collapsed_error,
    digest_disagreement,
    rank_error,
)
from shardserve_scheduler.methods import ModelStep, PythonStep
from shardserve_scheduler.pystages import Outcome, PythonTask
from shardserve_scheduler.timeline import Timeline

__all__ = ["Call", "RequestMachine"]

PyKey = tuple[LaneKey, str, int]  # (servable version, method, step position)


class RequestMachine:
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

    # ------------------------------------------------------------------ queries

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
        """When the earliest open batch is due (the shell ticks then), or None."""
        dues = [
            lane.batcher.next_due() for lane in self._lanes.values() if lane.batcher is not None
        ]
        known = [d for d in dues if d is not None]
        return min(known) if known else None

    def forget(self, servable: str, version: int) -> None:
        """Drop an unloaded version's lane and statistics (it has no open request)."""
        self._lanes.pop((servable, version), None)
        self.stats.pop((servable, version), None)

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
        for index in range(len(instances)):
            actions += self._advance(state, index, now)
        return actions + self._settle(now)

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
            actions = self._fail_job(job, *rank_error(job, result.rank, result.error), now)
        elif len(job.results) < len(job.stage_ranks()):
            return []
        else:
            actions = self._stage_complete(job, now)
        return actions + self._settle(now)

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

    def _lane(self, call: Call) -> Lane:
        lane = self._lanes.get(call.lane_key)
        if lane is None:
            group = call.group
            limit = group.max_batch_size or self.max_batch_size
            batches = group.with_batch_dim and (group.max_batch_size > 0 or limit > 1)
            batcher = Batcher(limit, self.batch_delay) if batches else None
            lane = self._lanes[call.lane_key] = Lane(group, batcher, call.method.no_batch_inputs)
        return lane

    def _new_id(self, kind: str) -> str:
        self._next_id += 1
        return f"{self._prefix}-{kind}{self._next_id}"

    # ------------------------------------------------------------------ instance flow

    def _alive(self, key: str, index: int, position: int) -> RequestState | None:
        """The request, if this instance is still open and at this step."""
        state = self.requests.get(key)
        if state is None:
            return None
        instance = state.instances[index]
        return state if instance.outcome is None and instance.step == position else None

    def _advance(self, state: RequestState, index: int, now: float) -> list[Action]:
        """Move an instance on to its next step (or to its end)."""
        instance = state.instances[index]
        plan = state.call.method
        if instance.step == len(plan.steps):
            outputs = plan.method_outputs(instance.env, state.call.request.outputs)
            return self._instance_done(state, index, InstanceResult(outputs=outputs), now)
        step = plan.steps[instance.step]
        if isinstance(step, PythonStep):
            key: PyKey = (state.call.lane_key, plan.name, instance.step)
            self._py_waiting.setdefault(key, (step, []))[1].append((state.key, index))
            instance.where = f"Python stage {step.index} ({step.tag})"
            return []
        return self._enter_model(state, index, step, now)

    def _enter_model(
        self, state: RequestState, index: int, step: ModelStep, now: float
    ) -> list[Action]:
        call, instance = state.call, state.instances[index]
        inputs = call.method.model_inputs(step, instance.env)
        lane = self._lane(call)
        try:
            check_instance(inputs, call.group.inputs, batch_dim=call.group.with_batch_dim)
            rows = batching.rows_of(inputs, lane.no_batch) if lane.batcher is not None else 1
        except (InferenceError, ValueError) as exc:
            text = exc.message if isinstance(exc, InferenceError) else str(exc)
            message = f"stage {step.index} ({step.tag}) input: {text}"
            return self._fail_instance(state, index, ErrorCode.BAD_INPUT, message, now)
        instance.where = "waiting for the model"
        if lane.batcher is None:
            instance.chunks = [None]
            self._queue_job(lane, [((state.key, index, 0, instance.step), inputs)], None, now)
            return []
        pieces = batching.chunk(inputs, lane.no_batch, rows, lane.batcher.limit)
        instance.chunks = [None] * len(pieces)
        for c, part in enumerate(pieces):
            member = (state.key, index, c, instance.step)
            part_rows = rows if len(pieces) == 1 else batching.rows_of(part, lane.no_batch)
            key = batching.batch_key(part, lane.no_batch)
            for full in lane.batcher.add(Piece(member, part, part_rows, now, key)):
                self._batch_job(lane, full, now)
        return []

    def _batch_job(self, lane: Lane, pieces: list[Piece], now: float) -> None:
        live = [p for p in pieces if self._alive(*_key3(p.member))]
        if not live:
            return
        inputs, ranges = batching.combine(live, lane.no_batch, lane.group.max_batch_size)
        self._queue_job(lane, [(p.member, inputs) for p in live], ranges, now)

    def _queue_job(
        self,
        lane: Lane,
        members: list[tuple[Member, TensorMap]],
        ranges: tuple[tuple[int, int], ...] | None,
        now: float,
    ) -> None:
        states = [self.requests[m[0]] for m, _ in members]
        job = Job(
            self._new_id("j"),
            lane.group,
            tuple(m for m, _ in members),
            ranges,
            members[0][1],
            max(s.call.request.deadline for s in states),
            Timeline(min(s.accepted_at for s in states)),
        )
        job.timeline.mark(now, f"queued ({len(members)} member(s))")
        self.jobs[job.id] = job
        for state in states:
            state.jobs.add(job.id)
        lane.queued.append(job)
        stats = self.stats.setdefault(job.lane_key, VersionStats())
        stats.batches_total += 1
        stats.batched_instances_total += len(members)

    def _settle(self, now: float) -> list[Action]:
        """After every event: flush due batches, start Python tasks, start queued jobs."""
        for lane in self._lanes.values():
            if lane.batcher is not None:
                for pieces in lane.batcher.due(now):
                    self._batch_job(lane, pieces, now)
        actions = self._start_python()
        for lane in self._lanes.values():
            actions += self._pump(lane, now)
        return actions

    def _start_python(self) -> list[Action]:
        actions: list[Action] = []
        waiting, self._py_waiting = self._py_waiting, {}
        for key, (step, members) in waiting.items():
            live = [(k, i) for k, i in members if self._alive(k, i, key[2])]
            size = 1 if step.batch_size is None else (step.batch_size or self.max_batch_size)
            for start in range(0, len(live), size):
                chunk = live[start : start + size]
                task_id = self._new_id("p")
                self._py_tasks[task_id] = (key, chunk)
                args = tuple(self._python_args(step, k, i) for k, i in chunk)
                actions.append(RunPython(PythonTask(task_id, key[1], step, args)))
        return actions

    def _python_args(self, step: PythonStep, key: str, index: int) -> tuple[Tensor, ...]:
        env = self.requests[key].instances[index].env
        return tuple(env[ref] for ref in step.inputs)

    def _pump(self, lane: Lane, now: float) -> list[Action]:
        """Publish stage 0 of queued jobs while the version has room in flight."""
        actions: list[Action] = []
        while lane.queued and len(lane.inflight) < self.max_inflight:
            job = lane.queued.popleft()
            if job.id not in self.jobs:
                continue
            if not self._live_members(job):
                del self.jobs[job.id]  # every request it served already ended
                continue
            lane.inflight.add(job.id)
            for key, index, _, _ in job.members:
                if key in self.requests:
                    self.requests[key].instances[index].where = "in the model"
            actions.append(self._publish(job, 0, job.inputs, digest_tensors(job.inputs), now))
        return actions

    def _live_members(self, job: Job) -> list[Member]:
        return [m for m in job.members if self._alive(m[0], m[1], m[3])]

    def _publish(
        self, job: Job, stage: int, inputs: TensorMap, digest: str, now: float
    ) -> PublishStageWork:
        job.stage = stage
        job.results = {}
        job.inputs = {}  # the inputs live in the message now; keep no second copy
        job.timeline.mark(now, f"s{stage} publish")
        ids = dict.fromkeys(
            self.requests[key].call.request.id for key, *_ in job.members if key in self.requests
        )
        work = StageWork(
            job=job.id,
            servable=job.servable,
            version=job.group.version,
            stage=stage,
            inputs=inputs,
            digest=digest,
            deadline=job.deadline,
            result_to=self.result_to,
            requests=tuple(ids),
        )
        return PublishStageWork(work)

    # ------------------------------------------------------------------ job outcomes

    def _stage_complete(self, job: Job, now: float) -> list[Action]:
        disagreement = digest_disagreement(job)
        if disagreement:
            return self._fail_job(job, ErrorCode.INTERNAL, disagreement, now)
        leader = job.group.leader_of(job.stage)
        outputs = job.results[leader].outputs
        label = f"stage {job.stage} leader rank {leader} of {job.servable} v{job.group.version}"
        if outputs is None:
            return self._fail_job(job, ErrorCode.INTERNAL, f"{label} sent no outputs", now)
        digest = digest_tensors(outputs)
        if digest != job.results[leader].digest:
            message = f"{label}: outputs do not match the digest the ranks agreed on"
            return self._fail_job(job, ErrorCode.INTERNAL, message, now)
        if job.stage + 1 < job.group.stage_size:
            return [self._publish(job, job.stage + 1, outputs, digest, now)]
        return self._finish_job(job, outputs, now)

    def _finish_job(self, job: Job, outputs: TensorMap, now: float) -> list[Action]:
        actions = self._retire(job, now)
        try:
            parts = batching.split(outputs, job.ranges) if job.ranges else [outputs]
        except ValueError as exc:
            return actions + self._fail_members(job, ErrorCode.INTERNAL, str(exc), now)
        for member, part in zip(job.members, parts, strict=True):
            actions += self._member_done(member, part, now)
        return actions

    def _member_done(self, member: Member, outputs: TensorMap, now: float) -> list[Action]:
        key, index, chunk, position = member
        state = self._alive(key, index, position)
        if state is None:
            return []
        plan, instance = state.call.method, state.instances[index]
        missing = [n for n in plan.model_outputs_names if n not in outputs]
        if missing:
            message = f"the model sent no output(s) {', '.join(missing)}"
            return self._fail_instance(state, index, ErrorCode.INTERNAL, message, now)
        instance.chunks[chunk] = outputs
        if any(c is None for c in instance.chunks):
            return []
        joined = batching.join_chunks([c for c in instance.chunks if c is not None])
        step = plan.steps[position]
        assert isinstance(step, ModelStep)
        plan.store_model_outputs(step, instance.env, joined)
        instance.chunks = []
        instance.step += 1
        return self._advance(state, index, now)

    def _retire(self, job: Job, now: float) -> list[Action]:
        """Forget a job (its lane slot frees); log its timeline."""
        del self.jobs[job.id]
        lane = self._lanes.get(job.lane_key)
        if lane:
            lane.inflight.discard(job.id)
        for key, *_ in job.members:
            if key in self.requests:
                self.requests[key].jobs.discard(job.id)
        request_id = next(
            (self.requests[k].call.request.id for k, *_ in job.members if k in self.requests), "-"
        )
        return [debug(f"job {job.id} timeline: {job.timeline.render(now)}", request_id)]

    def _fail_job(self, job: Job, code: ErrorCode, message: str, now: float) -> list[Action]:
        """A job ends in error: fail every instance it serves, and cancel it on its ranks."""
        actions = self._fail_members(job, code, message, now)
        if job.id in self.jobs:
            actions += self._drop_job(job, message, now)
        return actions

    def _fail_members(self, job: Job, code: ErrorCode, message: str, now: float) -> list[Action]:
        actions: list[Action] = []
        for key, index, _, position in dict.fromkeys(job.members):
            state = self._alive(key, index, position)
            if state is not None:
                actions += self._fail_instance(state, index, code, message, now)
        return actions

    def _drop_job(self, job: Job, reason: str, now: float) -> list[Action]:
        published = job.stage >= 0
        actions = self._retire(job, now)
        if published:
            cancel = JobCancel(
                job=job.id, servable=job.servable, version=job.group.version, reason=reason
            )
            actions.append(Cancel(cancel))
        return actions

    def _prune(self, state: RequestState, now: float) -> list[Action]:
        """Drop the jobs of this request that serve no open instance any more."""
        actions: list[Action] = []
        for job_id in sorted(state.jobs):
            job = self.jobs.get(job_id)
            if job is None:
                state.jobs.discard(job_id)
            elif not self._live_members(job):
                actions += self._drop_job(job, "every request it served has ended", now)
            elif not any(m[0] == state.key and self._alive(*_key3(m)) for m in job.members):
                state.jobs.discard(job_id)
        return actions

    # ------------------------------------------------------------------ request outcomes

    def _instance_done(
        self, state: RequestState, index: int, result: InstanceResult, now: float
    ) -> list[Action]:
        state.instances[index].outcome = result
        state.instances[index].chunks = []
        if state.open_instances:
            return []
        return self._reply(state, now)

    def _fail_instance(
        self, state: RequestState, index: int, code: ErrorCode, message: str, now: float
    ) -> list[Action]:
        result = InstanceResult(error=ErrorInfo(code=code, message=message))
        state.instances[index].outcome = result
        state.instances[index].chunks = []
        prefix = f"instance {index} " if len(state.instances) > 1 else "request "
        level = logging.INFO if code == ErrorCode.BAD_INPUT else logging.WARNING
        actions: list[Action] = [
            Log(level, f"{prefix}failed ({code.value}): {message}", state.call.request.id)
        ]
        actions += self._prune(state, now)
        if not state.open_instances:
            actions += self._reply(state, now)
        return actions

    def _reply(self, state: RequestState, now: float) -> list[Action]:
        call = state.call
        results = [i.outcome for i in state.instances if i.outcome is not None]
        error = collapsed_error(results)
        reply = InferReply(
            id=call.request.id,
            servable=call.group.servable,
            version=call.group.version,
            method=call.request.method,
            instances=() if error else tuple(results),
            error=error,
        )
        failed = any(r.error is not None for r in results)
        self._close(state, failed)
        return [self._count_reply(Reply(call.reply_to, call.correlation_id, reply))]

    def _fail_request(
        self, state: RequestState, code: ErrorCode, message: str, now: float
    ) -> list[Action]:
        """Reply one error to a whole request and drop every job only it still needs."""
        call = state.call
        reply = error_reply(
            call.request,
            call.reply_to,
            call.correlation_id,
            code,
            message,
            version=call.group.version,
        )
        level = (
            logging.INFO if code in (ErrorCode.DEADLINE, ErrorCode.UNAVAILABLE) else logging.WARNING
        )
        self._close(state, failed=True)
        actions: list[Action] = [
            self._count_reply(reply),
            Log(level, f"request failed ({code.value}): {message}", call.request.id),
        ]
        return actions + self._prune(state, now)

    def _close(self, state: RequestState, failed: bool) -> None:
        del self.requests[state.key]
        if failed:
            self.counters.failed += 1
            self.stats.setdefault(state.call.lane_key, VersionStats()).errors_total += 1
        else:
            self.counters.succeeded += 1

    def _count_reply(self, reply: Reply) -> Reply:
        self.counters.replied += 1
        return reply


def _key3(member: Member) -> tuple[str, int, int]:
    return member[0], member[1], member[3]


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

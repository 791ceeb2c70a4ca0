"""Instances moving through their method's steps: Python tasks, batching, job queueing,
and publishing stage 0 while a version has room in flight.

A Python step becomes a ``RunPython`` action (the shell runs it in a worker pool); a
batched Python step (batch_size 0 or k) gets a list of the instances waiting for it after
the current event, at most k (0: the maximum batch size) per call. The model step makes
jobs: one per instance (``with_batch_dim=False``, or ``max_batch_size`` 1), or batches of
instances of several requests (see ``batching``). Queued jobs start at the end of every
event, after the event's own publishes, so with several stages jobs pipeline.
"""

from __future__ import annotations

from shardserve.errors import ErrorCode, InferenceError
from shardserve.repo.signature import check_instance
from shardserve.wire.protocol import InstanceResult, StageWork, TensorMap
from shardserve.wire.tensors import Tensor, digest_tensors
from shardserve_scheduler.core import batching
from shardserve_scheduler.core.actions import Action, PublishStageWork, RunPython
from shardserve_scheduler.core.batching import Member, Piece
from shardserve_scheduler.core.job_outcomes import JobOutcomes, alive_key
from shardserve_scheduler.core.jobs import Job, Lane, RequestState, VersionStats
from shardserve_scheduler.core.machine_state import PyKey
from shardserve_scheduler.core.methods import ModelStep, PythonStep
from shardserve_scheduler.core.pystages import PythonTask
from shardserve_scheduler.core.timeline import Timeline


class Progress(JobOutcomes):
    """Advancing instances; forming, queueing and starting jobs."""

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
        member = (state.key, index, 0, instance.step)
        if lane.batcher is None or (lane.stacking and not batching.stackable(inputs)):
            instance.chunks = [None]
            self._queue_job(lane, [(member, inputs)], None, now)
            return []
        actions: list[Action] = []
        if lane.stacking:
            instance.chunks = [None]
            piece = Piece(member, inputs, 1, now, batching.stack_key(inputs))
            for full in lane.batcher.add(piece):
                actions += self._batch_job(lane, full, now)
            return actions
        pieces = batching.chunk(inputs, lane.no_batch, rows, lane.batcher.limit)
        instance.chunks = [None] * len(pieces)
        for c, part in enumerate(pieces):
            member = (state.key, index, c, instance.step)
            part_rows = rows if len(pieces) == 1 else batching.rows_of(part, lane.no_batch)
            key = batching.batch_key(part, lane.no_batch)
            for full in lane.batcher.add(Piece(member, part, part_rows, now, key)):
                actions += self._batch_job(lane, full, now)
        return actions

    def _batch_job(self, lane: Lane, pieces: list[Piece], now: float) -> list[Action]:
        """Queue one job for a batch that left the batcher. A bug forming it fails the
        batch's instances at once (its pieces have left the batcher: nothing else would
        answer them before their deadline); other batches of the event go on."""
        try:
            self._form_job(lane, pieces, now)
            return []
        except Exception as exc:
            actions: list[Action] = []
            for key, index, position in dict.fromkeys(alive_key(p.member) for p in pieces):
                state = self._alive(key, index, position)
                if state is not None:
                    doing = "while forming a batch"
                    actions += self._fail_instance_after_bug(state, index, doing, exc, now)
            return actions

    def _form_job(self, lane: Lane, pieces: list[Piece], now: float) -> None:
        live = [p for p in pieces if self._alive(*alive_key(p.member))]
        if not live:
            return
        if lane.stacking and len(live) > 1:
            inputs = batching.stack(live)
            self._queue_job(lane, [(p.member, inputs) for p in live], None, now, len(live))
            return
        if lane.stacking:  # one instance: a plain job
            self._queue_job(lane, [(live[0].member, live[0].inputs)], None, now)
            return
        inputs, ranges = batching.combine(live, lane.no_batch, lane.group.max_batch_size)
        self._queue_job(lane, [(p.member, inputs) for p in live], ranges, now)

    def _queue_job(
        self,
        lane: Lane,
        members: list[tuple[Member, TensorMap]],
        ranges: tuple[tuple[int, int], ...] | None,
        now: float,
        stacked: int = 0,
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
            stacked=stacked,
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
        actions: list[Action] = []
        for lane in self._lanes.values():
            if lane.batcher is not None and lane.hungry:
                for pieces in lane.batcher.due(now):
                    actions += self._batch_job(lane, pieces, now)
        actions += self._start_python()
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
            stacked=job.stacked,
        )
        return PublishStageWork(work)

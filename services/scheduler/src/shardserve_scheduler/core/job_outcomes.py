"""A job's stage results: the next stage, the job's end, or its failure.

Per job and stage, every rank of the stage must answer (the leader alone where the
stage's outputs are combined there, ``jobs.stage_answered``): all digests equal -> the
next stage (inputs = the leader's outputs) or the job's end; a rank error or a digest
disagreement fails the job's instances (and cancels the job on its ranks).
"""

from __future__ import annotations

from shardserve.errors import ErrorCode
from shardserve.wire.protocol import JobCancel, TensorMap
from shardserve.wire.tensors import digest_mismatch, digest_tensors
from shardserve_scheduler.core import batching
from shardserve_scheduler.core.actions import (
    Action,
    Cancel,
    PublishStageWork,
    bug_log,
    bug_message,
    debug,
)
from shardserve_scheduler.core.batching import Member
from shardserve_scheduler.core.jobs import Job, RequestState, digest_disagreement
from shardserve_scheduler.core.methods import ModelStep
from shardserve_scheduler.core.replies import Replies


class JobOutcomes(Replies):
    """Stage completion, job end, job failure, and dropping jobs nobody needs."""

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
        mismatch = "outputs do not match the digest the ranks agreed on"
        problem = digest_mismatch(job.results[leader].digest, digest, mismatch)
        if problem:
            return self._fail_job(job, ErrorCode.INTERNAL, f"{label}: {problem}", now)
        if job.stage + 1 < job.group.stage_size:
            return [self._publish(job, job.stage + 1, outputs, digest, now)]
        return self._finish_job(job, outputs, now)

    def _finish_job(self, job: Job, outputs: TensorMap, now: float) -> list[Action]:
        actions = self._retire(job, now)
        try:
            if job.stacked:
                parts = batching.unstack(outputs, job.stacked)
            else:
                parts = batching.split(outputs, job.ranges) if job.ranges else [outputs]
        except ValueError as exc:
            return actions + self._fail_members(job, ErrorCode.INTERNAL, str(exc), now)
        for member, part in zip(job.members, parts, strict=True):
            actions += self._member_done_or_failed(job, member, part, now)
        return actions

    def _member_done_or_failed(
        self, job: Job, member: Member, outputs: TensorMap, now: float
    ) -> list[Action]:
        """``_member_done``; a bug there fails that member's instance alone."""
        try:
            return self._member_done(member, outputs, now)
        except Exception as exc:
            state = self.requests.get(member[0])
            doing = f"handling a result of job {job.id}"
            if state is None:
                return [bug_log(bug_message(doing, exc))]
            return self._fail_instance_after_bug(state, member[1], doing, exc, now)

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
            elif not any(m[0] == state.key and self._alive(*alive_key(m)) for m in job.members):
                state.jobs.discard(job_id)
        return actions

    def _publish(
        self, job: Job, stage: int, inputs: TensorMap, digest: str, now: float
    ) -> PublishStageWork:
        raise NotImplementedError  # Progress


def alive_key(member: Member) -> tuple[str, int, int]:
    """The (request key, instance index, step position) that ``_alive`` checks."""
    return member[0], member[1], member[3]

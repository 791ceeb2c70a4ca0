"""A job's stage results: the next stage, the job's end, or its failure.

Per job and stage, every rank of the stage must answer (the leader alone where the
stage's outputs are combined there, ``jobs.stage_answered``): all digests equal -> the
next stage (inputs = the leader's outputs) or the job's end; a rank error or a digest
disagreement fails the job's instances (and cancels the job on its ranks).
"""

from __future__ import annotations

import logging

from shardserve.errors import ErrorCode
from shardserve.wire.protocol import StageResult, TensorMap
from shardserve.wire.tensors import digest_mismatch, digest_tensors
from shardserve_scheduler.core import batching
from shardserve_scheduler.core.actions import Action, Log, bug_log, bug_message
from shardserve_scheduler.core.batching import Member
from shardserve_scheduler.core.jobs import Counters, Job, digest_disagreement
from shardserve_scheduler.core.lanes import Lanes
from shardserve_scheduler.core.methods import ModelStep
from shardserve_scheduler.core.open_requests import OpenRequests
from shardserve_scheduler.core.progress import Progress
from shardserve_scheduler.core.replies import Replies


class JobOutcomes:
    """Rank results recorded, stage completion, job end, job failure."""

    def __init__(
        self,
        counters: Counters,
        requests: OpenRequests,
        lanes: Lanes,
        replies: Replies,
        progress: Progress,
    ) -> None:
        self._counters = counters
        self._requests = requests
        self._lanes = lanes
        self._replies = replies
        self._progress = progress

    def record(self, result: StageResult, now: float) -> Job | list[Action]:
        """The job a rank's result is recorded for; or, for a late, stray or repeated
        result (not recorded), the actions that say so."""
        job = self._lanes.job(result.job)
        counters = self._counters
        if job is None or result.stage != job.stage:
            counters.late_results += 1
            return []
        if result.rank not in job.stage_ranks():
            counters.stray_results += 1
            return [
                Log(
                    logging.WARNING,
                    f"job {job.id}: rank {result.rank} is not in stage {job.stage}; result ignored",
                )
            ]
        if result.rank in job.results:
            counters.duplicate_results += 1
            return []
        job.results[result.rank] = result
        job.timeline.mark(now, f"s{job.stage} r{result.rank}")
        return job

    def stage_complete(self, job: Job, now: float) -> list[Action]:
        disagreement = digest_disagreement(job)
        if disagreement:
            return self.fail_job(job, ErrorCode.INTERNAL, disagreement, now)
        leader = job.group.leader_of(job.stage)
        outputs = job.results[leader].outputs
        label = f"stage {job.stage} leader rank {leader} of {job.servable} v{job.group.version}"
        if outputs is None:
            return self.fail_job(job, ErrorCode.INTERNAL, f"{label} sent no outputs", now)
        digest = digest_tensors(outputs)
        mismatch = "outputs do not match the digest the ranks agreed on"
        problem = digest_mismatch(job.results[leader].digest, digest, mismatch)
        if problem:
            return self.fail_job(job, ErrorCode.INTERNAL, f"{label}: {problem}", now)
        if job.stage + 1 < job.group.stage_size:
            return [self._lanes.publish(job, job.stage + 1, outputs, digest, now)]
        return self._finish_job(job, outputs, now)

    def fail_job(self, job: Job, code: ErrorCode, message: str, now: float) -> list[Action]:
        """A job ends in error: fail every instance it serves, and cancel it on its ranks."""
        actions = self._fail_members(job, code, message, now)
        if self._lanes.job(job.id) is not None:
            actions += self._lanes.drop_job(job, message, now)
        return actions

    def fail_job_after_bug(self, job: Job, doing: str, exc: Exception, now: float) -> list[Action]:
        """Handling ``job`` raised: every instance it still serves gets an INTERNAL error
        now instead of waiting for its deadline; the traceback is logged."""
        message = bug_message(doing, exc)
        try:
            return [bug_log(message), *self.fail_job(job, ErrorCode.INTERNAL, message, now)]
        except Exception:  # failing it the regular way raised too
            actions: list[Action] = [bug_log(message)]
            for key in dict.fromkeys(k for k, *_ in job.members):
                state = self._requests.get(key)
                if state is not None:
                    actions += self._replies.abandon(state, message)
            return actions

    def _finish_job(self, job: Job, outputs: TensorMap, now: float) -> list[Action]:
        actions = self._lanes.retire(job, now)
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
            state = self._requests.get(member[0])
            doing = f"handling a result of job {job.id}"
            if state is None:
                return [bug_log(bug_message(doing, exc))]
            return self._replies.fail_instance_after_bug(state, member[1], doing, exc, now)

    def _member_done(self, member: Member, outputs: TensorMap, now: float) -> list[Action]:
        key, index, chunk, position = member
        state = self._requests.alive(key, index, position)
        if state is None:
            return []
        plan, instance = state.call.method, state.instances[index]
        missing = [n for n in plan.model_outputs_names if n not in outputs]
        if missing:
            message = f"the model sent no output(s) {', '.join(missing)}"
            return self._replies.fail_instance(state, index, ErrorCode.INTERNAL, message, now)
        instance.chunks[chunk] = outputs
        if any(c is None for c in instance.chunks):
            return []
        joined = batching.join_chunks([c for c in instance.chunks if c is not None])
        step = plan.steps[position]
        assert isinstance(step, ModelStep)
        plan.store_model_outputs(step, instance.env, joined)
        instance.chunks = []
        instance.step += 1
        return self._progress.advance(state, index, now)

    def _fail_members(self, job: Job, code: ErrorCode, message: str, now: float) -> list[Action]:
        actions: list[Action] = []
        for key, index, _, position in dict.fromkeys(job.members):
            state = self._requests.alive(key, index, position)
            if state is not None:
                actions += self._replies.fail_instance(state, index, code, message, now)
        return actions

"""Stage work: one job at a time, in delivery order, each ending in one StageResult.

All ranks of a stage receive the same jobs in the same order (one publish, one channel);
running them strictly in that order, one at a time, means peers always wait on the same
job's collectives and never on each other crosswise. Errors become ``StageResult.error``;
the worker itself never dies of a bad job.

Generation steps (StepWork) and frees (SequencesFree) come on the same queue and take
their turn in the same order; ``shardserve_agent.generation.steps`` runs them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aio_pika.abc import AbstractIncomingMessage

from shardserve.amqp.collective import CollectiveHub, JobCancelledError, JobCollective
from shardserve.errors import ErrorCode, InferenceError, ShardserveError
from shardserve.process.lifecycle import request_id_var
from shardserve.process.waits import set_within
from shardserve.runtime.kv_cache import KVCache
from shardserve.runtime.program import Env, run_stage
from shardserve.wire.protocol import (
    Message,
    SequencesFree,
    StageResult,
    StageWork,
    StepResult,
    StepWork,
)
from shardserve_agent.generation.steps import Stepper
from shardserve_agent.results import Timing, stage_done, stage_failed
from shardserve_agent.slice_loader import LoadedSlice
from shardserve_agent.work_checks import (
    describe_failure,
    digest_problem,
    finished,
    identity_problem,
)

_logger = logging.getLogger(__name__)

ResultPublisher = Callable[[str, StageResult | StepResult], Awaitable[None]]
QueuedWork = StageWork | StepWork | SequencesFree
Clock = Callable[[], float]


@dataclass(frozen=True)
class WorkStats:
    """What the heartbeat reports about this rank's work so far (jobs and steps)."""

    inflight: int = 0
    jobs_done: int = 0
    compute_ms_total: float = 0.0
    collective_ms_total: float = 0.0
    # generation servables: the KV cache (zeros for other servables)
    kv_capacity_bytes: int = 0
    kv_used_bytes: int = 0
    kv_bytes_per_token: int = 0
    sequences: int = 0


class StageWorker:
    """Runs this rank's share of each StageWork and reports the outcome."""

    def __init__(
        self,
        loaded: LoadedSlice,
        hub: CollectiveHub,
        publish_result: ResultPublisher,
        clock: Clock = time.time,
        kv_cache: KVCache | None = None,
    ) -> None:
        self._slice = loaded
        self._hub = hub
        self._publish_result = publish_result
        self._clock = clock
        # asyncio.Lock wakes waiters first-come first-served: deliveries run in arrival order.
        self._turn = asyncio.Lock()
        self._idle = asyncio.Event()
        self._idle.set()
        self._waiting = 0  # deliveries received and not yet answered
        self.draining = False
        self.inflight = 0
        self.completed = 0
        self.compute_ms_total = 0.0
        self.collective_ms_total = 0.0
        self.stepper = Stepper(loaded, hub, kv_cache, self.account, clock, self._send)

    def stats(self) -> WorkStats:
        cache = self.stepper.cache
        return WorkStats(
            inflight=self.inflight,
            jobs_done=self.completed,
            compute_ms_total=self.compute_ms_total,
            collective_ms_total=self.collective_ms_total,
            kv_capacity_bytes=cache.budget_bytes if cache else 0,
            kv_used_bytes=cache.used_bytes if cache else 0,
            kv_bytes_per_token=cache.bytes_per_token if cache else 0,
            sequences=len(cache.sequences()) if cache else 0,
        )

    async def handle(self, message: Message, incoming: AbstractIncomingMessage) -> None:
        """Broker handler of the work queue (acked when this returns)."""
        if not isinstance(message, StageWork | StepWork | SequencesFree):
            _logger.warning("dropping a %s message on the work queue", message.kind)
            return
        self._enter()
        try:
            async with self._turn:
                await self._take_turn(message)
        finally:
            self._leave()

    def _enter(self) -> None:
        self._waiting += 1
        self._idle.clear()

    def _leave(self) -> None:
        self._waiting -= 1
        if self._waiting == 0:
            self._idle.set()

    async def _take_turn(self, work: QueuedWork) -> None:
        if isinstance(work, SequencesFree):
            self.stepper.free(work)
            return
        # Log lines carry the ids of the requests this job serves (a batch has several).
        label = work.step if isinstance(work, StepWork) else ",".join(work.requests) or work.job
        token = request_id_var.set(label)
        self.inflight = 1
        try:
            result: StageResult | StepResult | None
            if isinstance(work, StepWork):
                result = await self.stepper.outcome(work, self.draining)
            else:
                result = await self._outcome(work)
            if result is not None:
                await self._send(work.result_to, result)
        finally:
            self.inflight = 0
            request_id_var.reset(token)

    async def wait_idle(self, within_s: float) -> bool:
        """Wait (bounded) until every received delivery is answered; True if so."""
        return await set_within(self._idle, within_s)

    async def _outcome(self, work: StageWork) -> StageResult | None:
        """The result to send; None when there is none to send (a cancelled job, or a
        non-leader whose stage outputs were combined at the leader)."""
        rank = self._slice.rank
        if self._hub.is_finished(work.job):
            _logger.info("job %s was cancelled before it started here; skipping", work.job)
            return None
        if self.draining:
            self._hub.finish(work.job)
            return self._error(work, ErrorCode.UNAVAILABLE, f"rank {rank} is shutting down")
        if work.deadline <= self._clock():
            _logger.warning("job %s reached its deadline before it started; dropped", work.job)
            self._hub.finish(work.job)
            return self._error(
                work, ErrorCode.DEADLINE, f"rank {rank}: deadline passed before the stage started"
            )
        problem = identity_problem(
            self._slice, work.servable, work.version, work.stage, work.inputs
        ) or await digest_problem(rank, work.inputs, work.digest)
        if problem is not None:
            self._hub.finish(work.job)
            return self._error(work, ErrorCode.INTERNAL, problem)
        return await self._run(work)

    async def _run(self, work: StageWork) -> StageResult | None:
        collective = self._hub.begin(work.job, work.deadline)
        started = time.perf_counter()
        try:
            outputs = await self._computed(work, collective)
            tensors, digest = await finished(outputs)
        except JobCancelledError as exc:
            _logger.info("%s", exc)
            return None
        except InferenceError as exc:
            _logger.warning("job %s failed: %s", work.job, exc.message)
            return self._error(work, exc.code, exc.message)
        except Exception as exc:  # a failing model or a broken peer part: report, keep serving
            _logger.exception("job %s failed on rank %d", work.job, self._slice.rank)
            return self._error(work, ErrorCode.INTERNAL, describe_failure(self._slice.rank, exc))
        finally:
            self._hub.finish(work.job)
        compute_ms = self.account(work.stage, started, collective.wait_ms)
        if not outputs and self._slice.stage.outputs:
            # The stage's outputs were combined at the leader, from this rank's part among
            # the others: the leader's result answers for this rank (the scheduler expects
            # no other; only an error is sent).
            return None
        shipped = tensors if self._slice.is_leader else None
        timing = Timing(compute_ms, collective.wait_ms)
        return stage_done(work, self._slice.rank, shipped, digest, timing)

    async def _computed(self, work: StageWork, collective: JobCollective) -> Env:
        """This rank's stage program run on the work's inputs (its peers in ``collective``)."""
        stage = self._slice.stage
        inputs: Env = {name: work.inputs[name].to_numpy() for name in stage.inputs}
        return await run_stage(
            stage,
            self._slice.runners,
            inputs,
            collective,
            stacked=work.stacked,
            outputs_at_leader=True,
        )

    def account(self, stage: int, started: float, wait_ms: float) -> float:
        """Count a finished job or step in the heartbeat's totals; its compute ms (time
        not spent waiting for peers)."""
        total_ms = (time.perf_counter() - started) * 1000
        compute_ms = max(total_ms - wait_ms, 0.0)
        self.completed += 1
        self.compute_ms_total += compute_ms
        self.collective_ms_total += wait_ms
        _logger.debug(
            "stage %d done in %.1f ms (%.1f ms waiting for peers)", stage, total_ms, wait_ms
        )
        return compute_ms

    def _error(self, work: StageWork, code: ErrorCode, message: str) -> StageResult:
        return stage_failed(work, self._slice.rank, code, message)

    async def _send(self, result_to: str, result: StageResult | StepResult) -> None:
        try:
            await self._publish_result(result_to, result)
        except ShardserveError as exc:  # broker down: the scheduler times the job out
            label = result.step if isinstance(result, StepResult) else result.job
            _logger.warning("could not send the result of %s: %s", label, exc)

"""Stage work: one job at a time, in delivery order, each ending in one StageResult.

All ranks of a stage receive the same jobs in the same order (one publish, one channel);
running them strictly in that order, one at a time, means peers always wait on the same
job's collectives and never on each other crosswise. Errors become ``StageResult.error``;
the worker itself never dies of a bad job.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import numpy as np
from aio_pika.abc import AbstractIncomingMessage

from shardserve.amqp.collective import CollectiveHub, JobCancelledError, JobCollective
from shardserve.errors import ErrorCode, InferenceError, ShardserveError
from shardserve.process.lifecycle import request_id_var
from shardserve.runtime.program import Env, run_stage
from shardserve.wire.protocol import ErrorInfo, Message, StageResult, StageWork
from shardserve.wire.tensors import Tensor, digest_mismatch, digest_tensors, tensor_bytes
from shardserve_agent.slice_loader import LoadedSlice

_logger = logging.getLogger(__name__)

ResultPublisher = Callable[[str, StageResult], Awaitable[None]]
Clock = Callable[[], float]

# Tensors bigger than this are digested and converted in a thread: a 64 MB activation
# takes tens of ms to hash and copy, and the event loop must keep heartbeating. Below, a
# thread hand-off costs more than the work: a TP8 rank digesting 1-1.5 MiB stacked jobs
# in a thread served 25-35 % fewer binary requests per second than inline.
OFF_LOOP_BYTES = 4 * 1024 * 1024


def _finished_tensors(outputs: Mapping[str, np.ndarray]) -> tuple[dict[str, Tensor], str]:
    tensors = {name: Tensor.from_numpy(array) for name, array in outputs.items()}
    return tensors, digest_tensors(tensors)


async def _finished(outputs: Mapping[str, np.ndarray]) -> tuple[dict[str, Tensor], str]:
    """The outputs as wire tensors and their digest; in a thread when they are big."""
    if sum(int(a.nbytes) for a in outputs.values()) > OFF_LOOP_BYTES:
        return await asyncio.to_thread(_finished_tensors, outputs)
    return _finished_tensors(outputs)


@dataclass(frozen=True)
class WorkStats:
    """What the heartbeat reports about this rank's work so far."""

    inflight: int = 0
    jobs_done: int = 0
    compute_ms_total: float = 0.0
    collective_ms_total: float = 0.0


class StageWorker:
    """Runs this rank's share of each StageWork and reports the outcome."""

    def __init__(
        self,
        loaded: LoadedSlice,
        hub: CollectiveHub,
        publish_result: ResultPublisher,
        clock: Clock = time.time,
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

    def stats(self) -> WorkStats:
        return WorkStats(
            inflight=self.inflight,
            jobs_done=self.completed,
            compute_ms_total=self.compute_ms_total,
            collective_ms_total=self.collective_ms_total,
        )

    async def handle(self, message: Message, incoming: AbstractIncomingMessage) -> None:
        """Broker handler of the work queue (acked when this returns)."""
        if not isinstance(message, StageWork):
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

    async def _take_turn(self, work: StageWork) -> None:
        # Log lines carry the ids of the requests this job serves (a batch has several).
        token = request_id_var.set(",".join(work.requests) or work.job)
        self.inflight = 1
        try:
            result = await self._outcome(work)
            if result is not None:
                await self._send(work.result_to, result)
        finally:
            self.inflight = 0
            request_id_var.reset(token)

    async def wait_idle(self, within_s: float) -> bool:
        """Wait (bounded) until every received delivery is answered; True if so."""
        if self._idle.is_set():
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=max(within_s, 0.0))
            return True
        except TimeoutError:
            return False

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
        problem = self._check(work) or await self._check_digest(work)
        if problem is not None:
            self._hub.finish(work.job)
            return self._error(work, ErrorCode.INTERNAL, problem)
        return await self._run(work)

    def _check(self, work: StageWork) -> str | None:
        """Why this work cannot run here, or None."""
        rank, stage = self._slice.rank, self._slice.stage
        group = self._slice.group
        if (work.servable, work.version, work.stage) != (
            group.servable,
            group.version,
            stage.index,
        ):
            return (
                f"rank {rank} serves {group.servable} v{group.version} stage {stage.index}, "
                f"got work for {work.servable} v{work.version} stage {work.stage}"
            )
        missing = [name for name in stage.inputs if name not in work.inputs]
        if missing:
            return f"rank {rank}: stage {stage.index} input(s) {', '.join(missing)} missing"
        return None

    async def _check_digest(self, work: StageWork) -> str | None:
        if tensor_bytes(work.inputs) > OFF_LOOP_BYTES:
            digest = await asyncio.to_thread(digest_tensors, work.inputs)
        else:
            digest = digest_tensors(work.inputs)
        problem = digest_mismatch(work.digest, digest, "digest mismatch (corrupted in transit?)")
        return f"rank {self._slice.rank}: stage input {problem}" if problem else None

    async def _run(self, work: StageWork) -> StageResult | None:
        collective = self._hub.begin(work.job, work.deadline)
        started = time.perf_counter()
        try:
            outputs = await self._computed(work, collective)
            tensors, digest = await _finished(outputs)
        except JobCancelledError as exc:
            _logger.info("%s", exc)
            return None
        except InferenceError as exc:
            _logger.warning("job %s failed: %s", work.job, exc.message)
            return self._error(work, exc.code, exc.message)
        except Exception as exc:  # a failing model or a broken peer part: report, keep serving
            _logger.exception("job %s failed on rank %d", work.job, self._slice.rank)
            return self._error(work, ErrorCode.INTERNAL, _describe(self._slice.rank, exc))
        finally:
            self._hub.finish(work.job)
        compute_ms = self._account(work, started, collective.wait_ms)
        if not outputs and self._slice.stage.outputs:
            # The stage's outputs were combined at the leader, from this rank's part among
            # the others: the leader's result answers for this rank (the scheduler expects
            # no other; only an error is sent).
            return None
        return self._result(work, tensors, digest, compute_ms, collective.wait_ms)

    def _result(
        self,
        work: StageWork,
        tensors: dict[str, Tensor],
        digest: str,
        compute_ms: float,
        collective_ms: float,
    ) -> StageResult:
        # Built from values made here (not from the wire): no re-validation needed.
        return StageResult.model_construct(
            job=work.job,
            servable=work.servable,
            version=work.version,
            stage=work.stage,
            rank=self._slice.rank,
            digest=digest,
            outputs=tensors if self._slice.is_leader else None,
            error=None,
            compute_ms=compute_ms,
            collective_ms=collective_ms,
        )

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

    def _account(self, work: StageWork, started: float, wait_ms: float) -> float:
        """Count a finished job in the heartbeat's totals; its compute ms (time not spent
        waiting for peers)."""
        total_ms = (time.perf_counter() - started) * 1000
        compute_ms = max(total_ms - wait_ms, 0.0)
        self.completed += 1
        self.compute_ms_total += compute_ms
        self.collective_ms_total += wait_ms
        _logger.debug(
            "stage %d done in %.1f ms (%.1f ms waiting for peers)", work.stage, total_ms, wait_ms
        )
        return compute_ms

    def _error(self, work: StageWork, code: ErrorCode, message: str) -> StageResult:
        return StageResult(
            job=work.job,
            servable=work.servable,
            version=work.version,
            stage=work.stage,
            rank=self._slice.rank,
            error=ErrorInfo(code=code, message=message),
        )

    async def _send(self, result_to: str, result: StageResult) -> None:
        try:
            await self._publish_result(result_to, result)
        except ShardserveError as exc:  # broker down: the scheduler times the job out
            _logger.warning("could not send the result of job %s: %s", result.job, exc)


def _describe(rank: int, exc: Exception) -> str:
    text = str(exc) or type(exc).__name__
    return f"rank {rank} failed to run its stage: {type(exc).__name__}: {text}"[:2000]

"""Collectives over RabbitMQ: each rank publishes its part once, gathers its peers' parts.

Every rank of a stage runs jobs in the same order, one at a time, so at most one job is
"active" here. Parts can arrive before this rank starts the job (a faster peer): they are
buffered by (job, step). Parts of jobs that already ended (finished, cancelled, dropped)
are discarded, and the buffer is bounded, so a job this rank never runs cannot leak.
Waiting is bounded by the job's deadline and aborted by a JobCancel.

Transport-free (parts go out through a ``publish`` callback, come in through ``accept``):
the agent wires it to its stage's collective queue, the standalone per-rank run
(``shardserve.lite``) to its run-scoped queue.

Two algorithms, chosen per collective by ``choose_algorithm``:

- **fanout**: every rank multicasts its part to the stage; R publishes, R*(R-1)
  deliveries, one hop. Every rank combines the same parts in rank order.
- **leader**: every other rank sends its part to the stage leader (its first rank) only;
  the leader combines in rank order and multicasts the combined result; R-1 + 1
  publishes, 2*(R-1) deliveries (+1 to the leader's own queue, dropped), two hops. All
  ranks use the leader's bytes, so they agree bit for bit.

Rule: leader when the stage has 3 or more ranks (and the transport can send to one
rank), fanout otherwise. Every delivery has a fixed cost (a broker routing + a consumer
wake-up + a decode) that dwarfs the bytes for activations of ordinary size: TP8 is 56
deliveries per collective by fanout, 14 by leader. Bytes never favour fanout: an
allgather moves (R*R-1)*S bytes by leader vs R*(R-1)*S by fanout (within 1/R), an
allreduce 2*(R-1)*S vs R*(R-1)*S. At R = 2 both make 2 deliveries and fanout saves the
hop. The part size is deliberately not an input: every rank must pick the same algorithm
without talking, and shards of an uneven split differ in size.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

import numpy as np

from shardserve.errors import DeadlineError, ShardserveError
from shardserve.protocol import CollectivePart
from shardserve.tensors import Tensor

_logger = logging.getLogger(__name__)

PartPublisher = Callable[[CollectivePart], Awaitable[None]]
PartSender = Callable[[int, CollectivePart], Awaitable[None]]  # (to rank, part)
Combine = Callable[[list[np.ndarray]], np.ndarray]
FANOUT, LEADER = "fanout", "leader"
LEADER_MIN_RANKS = 3


def choose_algorithm(ranks: int, point_to_point: bool) -> str:
    """The collective algorithm for a stage of ``ranks`` ranks (see the module docstring)."""
    return LEADER if point_to_point and ranks >= LEADER_MIN_RANKS else FANOUT


Clock = Callable[[], float]
StepParts = dict[int, np.ndarray]  # rank -> array


class JobCancelledError(ShardserveError):
    """The job was cancelled (it already has an outcome) while this rank worked on it."""


class _BoundedSet:
    """The most recent ``limit`` job ids (older ones are forgotten)."""

    def __init__(self, limit: int) -> None:
        self._items: OrderedDict[str, None] = OrderedDict()
        self._limit = limit

    def add(self, item: str) -> None:
        self._items[item] = None
        self._items.move_to_end(item)
        while len(self._items) > self._limit:
            self._items.popitem(last=False)

    def __contains__(self, item: object) -> bool:
        return item in self._items


class CollectiveHub:
    """Buffers incoming parts and hands them to the job being run."""

    def __init__(
        self,
        *,
        rank: int,
        stage: int,
        stage_ranks: tuple[int, ...],
        publish: PartPublisher,
        clock: Clock = time.time,
        finished_limit: int = 10_000,
        max_pending_jobs: int = 1_024,
        send_to: PartSender | None = None,
    ) -> None:
        self.rank = rank
        self.stage = stage
        self.ranks = stage_ranks
        self.leader = stage_ranks[0]
        self.algorithm = choose_algorithm(len(stage_ranks), send_to is not None)
        self._publish = publish
        self._send_to = send_to
        self._clock = clock
        self._pending: OrderedDict[str, dict[int, StepParts]] = OrderedDict()
        self._max_pending = max_pending_jobs
        self._finished = _BoundedSet(finished_limit)
        self._active: JobCollective | None = None

    def accept(self, part: CollectivePart) -> None:
        """Take one part from the wire (own parts are added locally, not from the wire)."""
        if part.rank == self.rank or part.job in self._finished:
            return
        if part.stage != self.stage or part.rank not in self.ranks:
            _logger.warning(
                "dropping collective part of job %s from rank %d stage %d: not a peer of rank %d",
                part.job,
                part.rank,
                part.stage,
                self.rank,
            )
            return
        try:
            array = part.tensor.to_numpy()
        except ShardserveError as exc:
            _logger.warning(
                "dropping malformed collective part of job %s from rank %d: %s",
                part.job,
                part.rank,
                exc,
            )
            return
        self.parts(part.job, part.step).setdefault(part.rank, array)
        if self._active is not None and self._active.job == part.job:
            self._active.changed.set()

    def parts(self, job: str, step: int) -> StepParts:
        """The buffer of one (job, step); creating it may evict the oldest buffered job."""
        steps = self._pending.get(job)
        if steps is None:
            steps = self._pending[job] = {}
            self._evict()
        return steps.setdefault(step, {})

    def _evict(self) -> None:
        active = self._active.job if self._active is not None else None
        while len(self._pending) > self._max_pending:
            oldest = next(iter(self._pending))
            if oldest == active:
                self._pending.move_to_end(oldest)
                continue
            del self._pending[oldest]
            _logger.warning(
                "dropping buffered collective parts of job %s: never started here", oldest
            )

    def begin(self, job: str, deadline: float) -> JobCollective:
        """Start the collectives of one job (the previous one must have finished)."""
        self._active = JobCollective(self, job, deadline)
        return self._active

    def finish(self, job: str) -> None:
        """The job ended on this rank: free its parts, ignore any that still come."""
        self._pending.pop(job, None)
        self._finished.add(job)
        if self._active is not None and self._active.job == job:
            self._active = None

    def cancel(self, job: str, reason: str) -> bool:
        """Drop a job (JobCancel); returns True if this rank was running it."""
        active = self._active
        self.finish(job)
        if active is not None and active.job == job:
            active.cancel(reason)
            return True
        return False

    def abort_active(self, reason: str) -> None:
        """Cancel whatever job is waiting on collectives (used when a drain runs out)."""
        if self._active is not None:
            self.cancel(self._active.job, reason)

    def is_finished(self, job: str) -> bool:
        return job in self._finished

    def now(self) -> float:
        return self._clock()

    async def publish(self, part: CollectivePart) -> None:
        await self._publish(part)

    async def send_to(self, rank: int, part: CollectivePart) -> None:
        assert self._send_to is not None
        await self._send_to(rank, part)


class JobCollective:
    """The ``program.Collective`` of one job on this rank."""

    def __init__(self, hub: CollectiveHub, job: str, deadline: float) -> None:
        self._hub = hub
        self.job = job
        self.deadline = deadline
        self.changed = asyncio.Event()
        self.wait_ms = 0.0
        self._cancel_reason: str | None = None

    def cancel(self, reason: str) -> None:
        self._cancel_reason = reason
        self.changed.set()

    def _part(self, step: int, array: np.ndarray) -> CollectivePart:
        # Made from our own array: no validation needed (from_numpy checks the dtype).
        return CollectivePart.model_construct(
            job=self.job,
            stage=self._hub.stage,
            step=step,
            rank=self._hub.rank,
            tensor=Tensor.from_numpy(array),
        )

    async def gather(self, step: int, array: np.ndarray) -> list[np.ndarray]:
        """Every rank's part of this step in rank order (fanout)."""
        hub = self._hub
        started = time.perf_counter()
        await hub.publish(self._part(step, array))
        parts = hub.parts(self.job, step)
        parts[hub.rank] = array
        try:
            await self._wait_for(step, parts, hub.ranks)
        finally:
            self.wait_ms += (time.perf_counter() - started) * 1000
        return [parts[r] for r in hub.ranks]

    async def allcombine(self, step: int, array: np.ndarray, combine: Combine) -> np.ndarray:
        """``combine`` of every rank's part, in rank order, identical bits on every rank."""
        hub = self._hub
        if hub.algorithm == FANOUT:
            return combine(await self.gather(step, array))
        started = time.perf_counter()
        parts = hub.parts(self.job, step)
        try:
            if hub.rank != hub.leader:
                await hub.send_to(hub.leader, self._part(step, array))
                await self._wait_for(step, parts, (hub.leader,))
                return parts[hub.leader]  # the leader's combined result
            parts[hub.rank] = array
            await self._wait_for(step, parts, hub.ranks)
            combined = combine([parts[r] for r in hub.ranks])
            await hub.publish(self._part(step, combined))
            return combined
        finally:
            self.wait_ms += (time.perf_counter() - started) * 1000

    async def _wait_for(self, step: int, parts: StepParts, ranks: tuple[int, ...]) -> None:
        while True:
            self.changed.clear()  # before checking, so no arrival can be missed
            if self._cancel_reason is not None:
                raise JobCancelledError(f"job {self.job} cancelled: {self._cancel_reason}")
            missing = [r for r in ranks if r not in parts]
            if not missing:
                return
            remaining = self.deadline - self._hub.now()
            if remaining <= 0:
                raise DeadlineError(
                    f"rank {self._hub.rank}: collective step {step} of job {self.job} reached "
                    f"the deadline without the part(s) of rank(s) {', '.join(map(str, missing))}"
                )
            try:
                await asyncio.wait_for(self.changed.wait(), timeout=remaining)
            except TimeoutError:
                continue

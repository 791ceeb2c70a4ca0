"""Collectives over RabbitMQ: each rank publishes its part once, gathers its peers' parts.

Every rank of a stage runs jobs in the same order, one at a time, so at most one job is
"active" here. Parts can arrive before this rank starts the job (a faster peer): they are
buffered by (job, step). Parts of jobs that already ended (finished, cancelled, dropped)
are discarded, and the buffer is bounded, so a job this rank never runs cannot leak.
Waiting is bounded by the job's deadline and aborted by a JobCancel.

Transport-free (parts go out through a ``publish`` callback, come in through ``accept``):
the agent wires it to its stage's collective queue, the standalone per-rank run
(``shardserve.lite``) to its run-scoped queue.

Three algorithms, chosen per collective by ``CollectiveHub.algorithm_for``:

- **fanout**: every rank sends its part to each peer; one hop, R*(R-1) deliveries: R-1
  point-to-point sends per rank where the transport has them (at 2 ranks: one), else one
  multicast to the stage per rank, which the broker also delivers back to its sender
  (R*R deliveries, R of them dropped). Every rank combines the same parts in rank order.
- **leader**: every other rank sends its part to the stage leader (its first rank) only;
  the leader combines in rank order and multicasts the combined result; R-1 + 1
  publishes, 2*(R-1) deliveries (+1 to the leader's own queue, dropped), two hops. All
  ranks use the leader's bytes, so they agree bit for bit.
- **sharded** (allreduce only): reduce-scatter, then allgather. Every rank cuts its part
  into R shards (by flat element index) and sends shard j to rank j; rank j sums the
  shards it holds in rank order and multicasts that summed shard; every rank joins the
  R summed shards. 2*R*(R-1) deliveries (+R to the senders' own queues, dropped), two
  hops; but each rank takes in and sends out 2*(R-1)/R of a part, where the leader
  takes in R-1 parts and sends one that the broker copies R-1 times, and the R partial
  sums run side by side instead of all on the leader. Every element is summed by one
  rank, in rank order, as the leader does: the same bits.

A stage's final collectives (whose results are only stage outputs, see
``StageSpec.final_collectives``) need their result at the leader alone: it is the only
rank that sends outputs (the others send a digest, which for such results would only re-
check the transit of bytes the leader sent or also received). There the leader algorithm
stops before its multicast (**to-leader**: R-1 deliveries, one hop; also at 2 ranks,
where fanout makes 2) and the sharded one sends the summed shards to the leader only
(**sharded-to-leader**: (R-1)*R + R-1 deliveries); the other ranks send their part and
are done, with no outputs and no result to send (the leader's answers for them,
``jobs.stage_answered`` in the scheduler). Without point-to-point sends every rank still
gathers. The leader's bits are the same.

Rule: fanout under 3 ranks (or when the transport cannot send to one rank); from 3
ranks, sharded for an allreduce whose shards would be at least ``MIN_SHARD_BYTES``
(parts of R times that), leader for everything else. Every delivery has a fixed cost (a
broker routing + a consumer wake-up + a decode) that dwarfs the bytes for activations of
ordinary size: TP8 is 56 deliveries per collective by fanout, 14 by leader, 112
sharded. Bytes never favour fanout over leader: an allgather moves (R*R-1)*S bytes by
leader vs R*(R-1)*S by fanout (within 1/R), an allreduce 2*(R-1)*S vs R*(R-1)*S. Only
big parts repay sharding, the bigger the more ranks; measured with
``python -m benchmarks --only allreduce`` (2 cores), leader time / sharded time: at 4
ranks 0.85 for 1 MiB parts, 1.04 for 4 MiB, 1.9 for 16 MiB; at 8 ranks 0.65 for 4 MiB,
1.33 for 8 MiB, 1.98 for 16 MiB. At R = 2 fanout and leader both make 2 deliveries and
fanout saves the hop. Every rank must pick the same algorithm without talking: an
allreduce's parts have the same shape on every rank (partial sums of one tensor), so
their size may decide; an allgather's shards of an uneven split differ in size, so for
allgathers it may not.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from typing import TypeVar

import numpy as np

from shardserve.errors import DeadlineError, ShardserveError
from shardserve.process.waits import set_within
from shardserve.wire.parts import Part, PartPhase
from shardserve.wire.protocol import CollectivePart

_logger = logging.getLogger(__name__)

# A rank's own parts go out as ``Part``s (no message to build: the transport writes the
# lean form, ``shardserve.wire.parts``, or ``Part.message()``).
PartPublisher = Callable[[Part], Awaitable[None]]
PartSender = Callable[[int, Part], Awaitable[None]]  # (to rank, part)
Combine = Callable[[list[np.ndarray]], np.ndarray]
FANOUT, LEADER, SHARDED = "fanout", "leader", "sharded"
# The final collectives of a stage, combined at the leader only (``JobCollective.to_leader``)
TO_LEADER, SHARDED_TO_LEADER = "to-leader", "sharded-to-leader"
LEADER_MIN_RANKS = 3
MIN_SHARD_BYTES = 1024 * 1024  # allreduce parts of R times this or more are sharded
Phase = PartPhase
_T = TypeVar("_T")


def choose_algorithm(ranks: int, point_to_point: bool) -> str:
    """The algorithm of a stage's allgathers, and of its allreduces of small parts (see
    the module docstring)."""
    return LEADER if point_to_point and ranks >= LEADER_MIN_RANKS else FANOUT


def sum_in_rank_order(parts: list[np.ndarray]) -> np.ndarray:
    """parts[0] + parts[1] + ... in that order (float addition is not associative: every
    rank adds in the same order to get the same bits)."""
    total = parts[0].copy()
    for part in parts[1:]:
        total += part
    return total


Clock = Callable[[], float]
StepParts = dict[int, np.ndarray]  # rank -> array
StepKey = tuple[int, Phase]  # (step, phase): the buffers of one job


def _array_of(part: CollectivePart) -> np.ndarray | None:
    """A message's array; None (logged) for one whose tensor does not decode."""
    try:
        return part.tensor.to_numpy()
    except ShardserveError as exc:
        _logger.warning(
            "dropping malformed collective part of job %s from rank %d: %s",
            part.job,
            part.rank,
            exc,
        )
        return None


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
        min_shard_bytes: int = MIN_SHARD_BYTES,
    ) -> None:
        self.rank = rank
        self.stage = stage
        self.ranks = stage_ranks
        self.leader = stage_ranks[0]
        self.algorithm = choose_algorithm(len(stage_ranks), send_to is not None)
        self._publish = publish
        self._send_to = send_to
        self._min_shard_bytes = min_shard_bytes
        self._clock = clock
        self._pending: OrderedDict[str, dict[StepKey, StepParts]] = OrderedDict()
        self._max_pending = max_pending_jobs
        self._finished = _BoundedSet(finished_limit)
        self._active: JobCollective | None = None
        self.runs: Counter[str] = Counter()  # collectives run, by algorithm

    def accept(self, part: Part | CollectivePart) -> None:
        """Take one part from the wire, lean (``Part``) or as a message (own parts are
        added locally, not from the wire)."""
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
        array = part.array if isinstance(part, Part) else _array_of(part)
        if array is None:
            return
        self.parts(part.job, part.step, part.phase).setdefault(part.rank, array)
        if self._active is not None and self._active.job == part.job:
            self._active.changed.set()

    @property
    def point_to_point(self) -> bool:
        """Whether parts can go to one rank (else only to the whole stage)."""
        return self._send_to is not None

    def algorithm_for(self, allreduce_bytes: int | None) -> str:
        """The algorithm of one collective: an allreduce of parts of ``allreduce_bytes``,
        or an allgather (None)."""
        sharded = (
            self.algorithm == LEADER
            and allreduce_bytes is not None
            and allreduce_bytes >= self._min_shard_bytes * len(self.ranks)
        )
        return SHARDED if sharded else self.algorithm

    def parts(self, job: str, step: int, phase: Phase = "part") -> StepParts:
        """The buffer of one (job, step, phase); creating a job's first buffer may evict
        the oldest buffered job."""
        steps = self._pending.get(job)
        if steps is None:
            steps = self._pending[job] = {}
            self._evict()
        return steps.setdefault((step, phase), {})

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

    async def publish(self, part: Part) -> None:
        await self._publish(part)

    async def send_to(self, rank: int, part: Part) -> None:
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

    def _part(self, step: int, array: np.ndarray, phase: Phase = "part") -> Part:
        return Part(self.job, self._hub.stage, step, self._hub.rank, phase, array)

    async def gather(self, step: int, array: np.ndarray) -> list[np.ndarray]:
        """Every rank's part of this step in rank order (fanout)."""
        hub = self._hub
        started = time.perf_counter()
        await self._to_peers(self._part(step, array))
        parts = hub.parts(self.job, step)
        parts[hub.rank] = array
        try:
            await self._wait_for(step, parts, hub.ranks)
        finally:
            self.wait_ms += (time.perf_counter() - started) * 1000
        return [parts[r] for r in hub.ranks]

    async def _to_peers(self, part: Part) -> None:
        """``part`` to every other rank: one by one where the transport can send to one
        rank (a multicast would also come back to this rank: a wasted delivery, through
        the broker and this rank's socket, for every part), else as one multicast."""
        hub = self._hub
        if not hub.point_to_point:
            await hub.publish(part)
            return
        for rank in hub.ranks:
            if rank != hub.rank:
                await hub.send_to(rank, part)

    async def allcombine(self, step: int, array: np.ndarray, combine: Combine) -> np.ndarray:
        """``combine`` of every rank's part, in rank order, identical bits on every rank."""
        hub = self._hub
        if hub.algorithm == FANOUT:
            hub.runs[FANOUT] += 1
            return combine(await self.gather(step, array))
        return await self._timed(LEADER, self._leader_combine(step, array, combine))

    async def _leader_combine(self, step: int, array: np.ndarray, combine: Combine) -> np.ndarray:
        """The parts combined at the leader, which multicasts the result to the others."""
        hub = self._hub
        combined = await self._parts_to_leader(step, array, combine)
        if combined is None:  # not the leader: wait for its combined result
            parts = hub.parts(self.job, step)
            await self._wait_for(step, parts, (hub.leader,))
            return parts[hub.leader]
        await hub.publish(self._part(step, combined))
        return combined

    async def to_leader(
        self, step: int, array: np.ndarray, combine: Combine, *, reduce: bool
    ) -> np.ndarray | None:
        """``combine`` of every rank's part at the stage leader only; None on the other
        ranks, which send their part and go on (see ``StageSpec.final_collectives``). The
        leader's bits are those every rank would get from ``allcombine``/``allreduce``:
        the same parts combined in the same order. From 2 ranks up (at 2, fanout would
        deliver 2 parts, this 1); ranks without point-to-point sends gather everywhere."""
        hub = self._hub
        if not hub.point_to_point:
            return await self.allcombine(step, array, combine)
        if reduce and hub.algorithm_for(array.nbytes) == SHARDED:
            return await self._timed(
                SHARDED_TO_LEADER, self._sharded_reduce(step, array, to_leader=True)
            )
        return await self._timed(TO_LEADER, self._parts_to_leader(step, array, combine))

    async def _parts_to_leader(
        self, step: int, array: np.ndarray, combine: Combine
    ) -> np.ndarray | None:
        """Every part to the leader, which combines them; None on the other ranks."""
        hub = self._hub
        if hub.rank != hub.leader:
            await hub.send_to(hub.leader, self._part(step, array))
            return None
        parts = hub.parts(self.job, step)
        parts[hub.rank] = array
        await self._wait_for(step, parts, hub.ranks)
        return combine([parts[r] for r in hub.ranks])

    async def allreduce(self, step: int, array: np.ndarray) -> np.ndarray:
        """The sum of every rank's part, added in rank order: the same bits on every rank
        whichever algorithm runs (the same additions in the same order)."""
        if self._hub.algorithm_for(array.nbytes) != SHARDED:
            return await self.allcombine(step, array, sum_in_rank_order)
        reduced = await self._timed(SHARDED, self._sharded_reduce(step, array, to_leader=False))
        assert reduced is not None  # every rank gets the result when not to_leader
        return reduced

    async def _timed(self, algorithm: str, run: Awaitable[_T]) -> _T:
        """``run``, counted under ``algorithm`` and its wall time added to ``wait_ms``."""
        self._hub.runs[algorithm] += 1
        started = time.perf_counter()
        try:
            return await run
        finally:
            self.wait_ms += (time.perf_counter() - started) * 1000

    async def _sharded_reduce(
        self, step: int, array: np.ndarray, *, to_leader: bool
    ) -> np.ndarray | None:
        """Reduce-scatter, then every summed shard to every rank (an allreduce) or to the
        leader alone (None on the other ranks)."""
        hub = self._hub
        shards = np.array_split(np.ascontiguousarray(array).reshape(-1), len(hub.ranks))
        for index, rank in enumerate(hub.ranks):
            if rank != hub.rank:
                await hub.send_to(rank, self._part(step, shards[index], "shard"))
        held = hub.parts(self.job, step, "shard")
        held[hub.rank] = shards[hub.ranks.index(hub.rank)]
        await self._wait_for(step, held, hub.ranks)
        mine = sum_in_rank_order([held[r] for r in hub.ranks])
        if not to_leader:
            await hub.publish(self._part(step, mine, "reduced"))
        elif hub.rank != hub.leader:
            await hub.send_to(hub.leader, self._part(step, mine, "reduced"))
            return None
        summed = hub.parts(self.job, step, "reduced")
        summed[hub.rank] = mine
        await self._wait_for(step, summed, hub.ranks)
        return np.concatenate([summed[r] for r in hub.ranks]).reshape(array.shape)

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
            await set_within(self.changed, remaining)

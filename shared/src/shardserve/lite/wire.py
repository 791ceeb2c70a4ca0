"""The standalone run's wire: run-scoped queues and keys on the collective exchange.

There is no scheduler: the ranks of one run find each other by a run id they all share,
then exchange collective parts and stage outputs directly. Layout (exchange
``shardserve.collective``, direct)::

    queue shardserve.run.<run>.r<rank>   exclusive (one process per rank and run; gone
                                         when the process ends), bound to
      run:<run>:all        every rank of the run: ready(rank) and failures
      run:<run>:s<stage>   the ranks of one stage: the stage's input
    queue shardserve.run.<run>.r<rank>.parts   exclusive too, bound to
      run:<run>:p<stage>   the ranks of one stage: collective parts, on a connection of
                           their own (``shardserve.amqp.collective_link``, as agents)

Keys start with ``run:`` and hold no ``.<version>.s<stage>`` tail, so they never meet an
agent's ``<servable>.<version>.s<stage>``. Messages are the serving ones:

- ready(rank): an ``AgentHello`` (servable, version, rank, stage, slice checksum) on
  ``all``. Rendezvous: declare the queue, then say hello; whenever a hello comes from a
  rank not seen before, say hello again (that rank's queue exists now, so it hears it).
  A rank starts predicting once it has heard every rank of the run, which also proves
  every queue exists, so no later publish is lost. Waiting is bounded; the error names
  the ranks that never showed up.
- collectives: ``CollectivePart`` (lean form, ``shardserve.wire.parts``) on ``p<stage>``
  or straight to one rank's parts queue, job id ``<run>:<n>`` for the n-th predict (ranks
  predict the same number of times, in the same order). A rank says hello only once
  both of its queues exist, so a part is never published to a queue not there yet.
- stage chaining: the leader of stage s publishes ``StageWork(job, stage=s+1, outputs)``
  on ``s<s+1>``; stage s+1 ranks check its digest and run on it.
- failure: a rank that fails a predict publishes ``StageResult(error)`` on ``all``; its
  peers stop waiting at once and fail naming it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass

from aio_pika.abc import AbstractIncomingMessage
from aio_pika.exceptions import AMQPError, ChannelClosed

from shardserve.amqp.broker import Broker
from shardserve.amqp.collective import MIN_SHARD_BYTES, CollectiveHub
from shardserve.amqp.collective_link import CollectiveLink
from shardserve.errors import ErrorCode, UnavailableError
from shardserve.lite.errors import LiteError, PeerFailedError, RendezvousError
from shardserve.process.redact import redact_url
from shardserve.process.settings import BrokerSettings
from shardserve.process.waits import set_within
from shardserve.repo.repository import GroupConfig
from shardserve.runtime.program import Env
from shardserve.wire.protocol import (
    AgentHello,
    CollectivePart,
    ErrorInfo,
    Message,
    StageResult,
    StageWork,
)
from shardserve.wire.tensors import Tensor, digest_mismatch, digest_tensors
from shardserve.wire.topology import COLLECTIVE_EXCHANGE, Binding, Queue

_logger = logging.getLogger(__name__)

PREFETCH = 1_000  # parts and hellos are small; a peer must never be blocked by us


def run_key_all(run: str) -> str:
    return f"run:{run}:all"


def run_key_stage(run: str, stage: int) -> str:
    return f"run:{run}:s{stage}"


def run_key_parts(run: str, stage: int) -> str:
    return f"run:{run}:p{stage}"


def run_queue(run: str, rank: int) -> Queue:
    return Queue(f"shardserve.run.{run}.r{rank}", exclusive=True, auto_delete=True)


def run_parts_queue(run: str, rank: int) -> Queue:
    return Queue(f"shardserve.run.{run}.r{rank}.parts", exclusive=True, auto_delete=True)


def run_bindings(run: str, rank: int, stage: int) -> tuple[Binding, ...]:
    name = run_queue(run, rank).name
    return (
        Binding(name, COLLECTIVE_EXCHANGE, run_key_all(run)),
        Binding(name, COLLECTIVE_EXCHANGE, run_key_stage(run, stage)),
    )


@dataclass(frozen=True)
class Failure:
    rank: int
    message: str


class RunMesh:
    """One rank's connection to the other ranks of its run."""

    def __init__(
        self,
        broker_settings: BrokerSettings,
        run: str,
        group: GroupConfig,
        rank: int,
        *,
        min_shard_bytes: int = MIN_SHARD_BYTES,  # (benchmarks compare algorithms)
    ) -> None:
        self.run = run
        self.group = group
        self.rank = rank
        self.stage = group.stage_of(rank)
        self._url = broker_settings.url
        self._broker = Broker(broker_settings, f"run-{run}-r{rank}")
        self._link = _parts_link(broker_settings, run, rank, self.stage.index)
        self.hub = CollectiveHub(
            rank=rank,
            stage=self.stage.index,
            stage_ranks=self.stage.ranks,
            publish=self._link.publish,
            send_to=self._link.send_to,
            min_shard_bytes=min_shard_bytes,
        )
        self._link.attach(self.hub.accept)
        self._seen: set[int] = {rank}
        self._inputs: dict[str, StageWork] = {}
        self._failures: dict[str, Failure] = {}
        self._changed = asyncio.Event()
        self._problem: str | None = None  # a peer that cannot be part of this run

    async def open(self) -> None:
        """Connect and declare this rank's queue (refused if the rank is already taken)."""
        try:
            await self._broker.connect()
        except (OSError, AMQPError, UnavailableError) as exc:
            raise UnavailableError(
                f"rank {self.rank}: cannot reach the message broker at "
                f"{redact_url(self._url)}: {exc}"
            ) from exc
        queue = run_queue(self.run, self.rank)
        try:
            await self._broker.declare(queue, run_bindings(self.run, self.rank, self.stage.index))
        except ChannelClosed as exc:
            raise RendezvousError(
                f"rank {self.rank} of run {self.run!r} is already running in another process "
                f"(queue {queue.name} is taken): {exc}"
            ) from exc
        await self._link.open()
        await self._broker.consume(queue.name, self._on_message, prefetch=PREFETCH)

    async def close(self) -> None:
        await self._link.close()
        await self._broker.close()

    # ------------------------------------------------------------ rendezvous

    async def rendezvous(self, timeout_s: float) -> None:
        """Wait until every rank of the run said hello (bounded by ``timeout_s``)."""
        everyone = set(range(self.group.rank_size))
        deadline = time.monotonic() + timeout_s
        await self._hello()
        while True:
            self._changed.clear()
            if self._problem is not None:
                raise RendezvousError(self._problem)
            if self._seen >= everyone:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RendezvousError(self._missing_message(everyone, timeout_s))
            await set_within(self._changed, remaining)

    def _missing_message(self, everyone: set[int], timeout_s: float) -> str:
        missing = sorted(everyone - self._seen)
        return (
            f"rank {self.rank}: run {self.run!r} of {self.group.servable} "
            f"v{self.group.version} needs {self.group.rank_size} ranks; after {timeout_s:g} s "
            f"still missing rank(s) {', '.join(map(str, missing))} (not started, failed to "
            f"load, or started with another run id / broker)"
        )

    async def _hello(self) -> None:
        hello = AgentHello(
            instance=f"run-{self.run}-r{self.rank}-{uuid.uuid4().hex[:8]}",
            servable=self.group.servable,
            version=self.group.version,
            rank=self.rank,
            stage=self.stage.index,
            slice_checksum=self.group.ranks[self.rank].checksum,
            host=socket.gethostname(),
            pid=os.getpid(),
        )
        await self._broker.publish(COLLECTIVE_EXCHANGE, run_key_all(self.run), hello)

    async def _on_hello(self, hello: AgentHello) -> None:
        if hello.rank == self.rank or hello.rank in self._seen:
            return
        problem = self._mismatch(hello)
        if problem is not None:
            self._problem = problem
        else:
            self._seen.add(hello.rank)
            await self._hello()  # its queue exists now: make sure it hears us
        self._changed.set()

    def _mismatch(self, hello: AgentHello) -> str | None:
        group = self.group
        if (hello.servable, hello.version) != (group.servable, group.version):
            return (
                f"run {self.run!r}: rank {hello.rank} runs {hello.servable} v{hello.version}, "
                f"this rank runs {group.servable} v{group.version} (use distinct run ids)"
            )
        if not 0 <= hello.rank < group.rank_size:
            return f"run {self.run!r}: rank {hello.rank} is outside rank_size {group.rank_size}"
        if hello.slice_checksum != group.ranks[hello.rank].checksum:
            return (
                f"run {self.run!r}: rank {hello.rank} loaded a different export "
                f"(slice checksum {hello.slice_checksum[:12]}..., this rank's group.json "
                f"says {group.ranks[hello.rank].checksum[:12]}...)"
            )
        return None

    # ------------------------------------------------------------ stage chaining

    async def stage_input(self, job: str, deadline: float) -> Env:
        """The input of this rank's stage for ``job``, sent by the previous stage's leader."""
        while True:
            self._changed.clear()
            self.raise_if_failed(job)
            work = self._inputs.pop(job, None)
            if work is not None:
                return self._checked(work)
            remaining = deadline - time.time()
            if remaining <= 0:
                leader = self.group.leader_of(self.stage.index - 1)
                raise PeerFailedError(
                    f"rank {self.rank}: no input for stage {self.stage.index} of {job} from "
                    f"stage {self.stage.index - 1} (leader rank {leader}) before the timeout"
                )
            await set_within(self._changed, remaining)

    def _checked(self, work: StageWork) -> Env:
        mismatch = f"digest mismatch for {work.job}"
        problem = digest_mismatch(work.digest, digest_tensors(work.inputs), mismatch)
        if problem:
            raise LiteError(f"rank {self.rank}: stage input {problem}")
        missing = [n for n in self.stage.inputs if n not in work.inputs]
        if missing:
            raise LiteError(f"rank {self.rank}: stage input(s) {', '.join(missing)} missing")
        return {name: work.inputs[name].to_numpy() for name in self.stage.inputs}

    async def send_stage_output(self, job: str, outputs: Env, deadline: float) -> None:
        """Hand this stage's outputs to the next stage (called by the stage leader only)."""
        tensors = {name: Tensor.from_numpy(a) for name, a in outputs.items()}
        work = StageWork(
            job=job,
            servable=self.group.servable,
            version=self.group.version,
            stage=self.stage.index + 1,
            inputs=tensors,
            digest=digest_tensors(tensors),
            deadline=deadline,
            result_to="",
        )
        await self._broker.publish(
            COLLECTIVE_EXCHANGE, run_key_stage(self.run, self.stage.index + 1), work
        )

    # ------------------------------------------------------------ failures

    def raise_if_failed(self, job: str) -> None:
        failure = self._failures.get(job)
        if failure is not None:
            raise PeerFailedError(
                f"rank {self.rank}: rank {failure.rank} failed {job}: {failure.message}"
            )

    async def announce_failure(self, job: str, message: str) -> None:
        """Tell every peer this rank failed ``job`` so they stop waiting for it."""
        failure = StageResult(
            job=job,
            servable=self.group.servable,
            version=self.group.version,
            stage=self.stage.index,
            rank=self.rank,
            error=ErrorInfo(code=ErrorCode.STAGE_FAILED, message=message[:2000]),
        )
        try:
            await self._broker.publish(COLLECTIVE_EXCHANGE, run_key_all(self.run), failure)
        except Exception as exc:  # the broker is gone: peers will time out instead
            _logger.warning("could not tell the peers that %s failed: %s", job, exc)

    def _on_failure(self, result: StageResult) -> None:
        if result.rank == self.rank or result.error is None:
            return
        self._failures.setdefault(result.job, Failure(result.rank, result.error.message))
        self.hub.cancel(result.job, f"rank {result.rank} failed: {result.error.message}")
        self._changed.set()

    # ------------------------------------------------------------ wire

    async def _on_message(self, message: Message, incoming: AbstractIncomingMessage) -> None:
        if isinstance(message, CollectivePart):  # (from a release that sent parts here)
            self.hub.accept(message)
        elif isinstance(message, AgentHello):
            await self._on_hello(message)
        elif isinstance(message, StageWork):
            if message.stage == self.stage.index:
                self._inputs[message.job] = message
                self._changed.set()
        elif isinstance(message, StageResult):
            self._on_failure(message)
        else:
            _logger.warning("dropping a %s message on run %s", message.kind, self.run)


def _parts_link(settings: BrokerSettings, run: str, rank: int, stage: int) -> CollectiveLink:
    """A rank's collective parts: its parts queue, on the link's own connection."""
    queue = run_parts_queue(run, rank)

    def peer_queue(peer: int) -> str:
        return run_parts_queue(run, peer).name

    key = run_key_parts(run, stage)
    return CollectiveLink(
        settings,
        f"run-{run}-r{rank}-parts",
        queue=queue,
        bindings=(Binding(queue.name, COLLECTIVE_EXCHANGE, key),),
        stage_route=(COLLECTIVE_EXCHANGE, key),
        peer_queue=peer_queue,
    )

"""The two request machines, inference and generation, as the shell drives them.

Every event the shell hears for a machine goes in through here, and every action a machine
answers with leaves through ``emit``: into the sender's queue, in the order produced.
Emitting also wakes the ticker (``until_due``) when a batch fell due sooner than the tick
it waits for, and keeps ``idle`` (no request or sequence open), which the drain waits for.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

from aio_pika.abc import AbstractIncomingMessage

from shardserve.process.waits import set_within
from shardserve.wire.protocol import Message, StageResult, StepResult
from shardserve_scheduler.core.actions import Action
from shardserve_scheduler.core.generation.machine import GenerationMachine
from shardserve_scheduler.core.pystages import Outcome
from shardserve_scheduler.core.registry import RankLoss
from shardserve_scheduler.core.requests import RequestMachine

_logger = logging.getLogger(__name__)

Clock = Callable[[], float]


class Machines:
    """Routes events to the machine they concern and their actions to ``put``."""

    def __init__(
        self,
        inference: RequestMachine,
        generation: GenerationMachine,
        *,
        put: Callable[[Action], None],
        clock: Clock,
    ) -> None:
        self.inference = inference
        self.generation = generation
        self._put = put
        self._clock = clock
        self._due = asyncio.Event()  # a batch became due sooner than the next tick
        self._idle = asyncio.Event()  # set while no request is open (for the drain)
        self._idle.set()

    def emit(self, actions: Iterable[Action]) -> None:
        for action in actions:
            self._put(action)
        if self.inference.next_wakeup() is not None:
            self._due.set()
        if self.inference.open_requests or self.generation.open_sequences:
            self._idle.clear()
        else:
            self._idle.set()

    def emit_settled(self, actions: Iterable[Action]) -> None:
        """``actions`` (one request message's), then the batches they completed."""
        self.emit([*actions, *self.inference.settle(self._clock())])

    async def on_result(self, message: Message, incoming: AbstractIncomingMessage) -> None:
        """Broker handler of the result queue: a rank's StageResult or StepResult."""
        if isinstance(message, StepResult):
            self.emit(self.generation.on_step_result(message, self._clock()))
        elif isinstance(message, StageResult):
            self.emit(self.inference.on_result(message, self._clock()))
        else:
            _logger.warning("ignoring a %s on the result queue", message.kind)

    def on_rank_lost(self, loss: RankLoss, now: float) -> None:
        """A rank's loss fails what runs on its group, in either machine."""
        self.emit(self.inference.on_rank_lost(loss.servable, loss.version, loss.message, now))
        self.emit(self.generation.on_rank_lost(loss.servable, loss.version, loss.message, now))

    def tick(self, now: float) -> None:
        self.emit(self.inference.tick(now))
        self.emit(self.generation.on_tick(now))

    async def until_due(self, at_most_s: float) -> None:
        """Until either machine wants a tick (a batch falls due, a deadline passes), at
        most ``at_most_s``."""
        timeout = at_most_s
        due = self._next_wakeup()
        if due is not None:
            timeout = min(timeout, max(0.0, due - self._clock()))
        self._due.clear()
        await set_within(self._due, timeout)

    def _next_wakeup(self) -> float | None:
        times = (self.inference.next_wakeup(), self.generation.next_wakeup())
        return min((t for t in times if t is not None), default=None)

    def fail_open(self, requests_why: str, generation_why: str) -> None:
        """Answer every open request and end every sequence, each with its message."""
        self.emit(self.inference.shutdown(requests_why, self._clock()))
        self.emit(self.generation.shutdown(generation_why, self._clock()))

    def on_publish_failed(self, job_id: str, message: str) -> None:
        if self.generation.owns_step(job_id):
            self.emit(self.generation.on_publish_failed(job_id, message, self._clock()))
            return
        self.emit(self.inference.on_publish_failed(job_id, message, self._clock()))

    def on_stream_gone(self, reply_to: str, correlation_id: str, why: str) -> None:
        """A chunk came back undeliverable (its reply queue is gone): nobody reads the
        stream any more, so its sequence ends now instead of running to max_tokens."""
        self.emit(self.generation.on_stream_gone(reply_to, correlation_id, why, self._clock()))

    def on_python_done(self, task_id: str, outcomes: list[Outcome]) -> None:
        self.emit(self.inference.on_python_done(task_id, outcomes, self._clock()))

    async def wait_idle(self, within_s: float) -> None:
        """Until nothing is open, or ``within_s`` passed."""
        await set_within(self._idle, within_s)

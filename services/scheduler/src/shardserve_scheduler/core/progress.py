"""Instances moving through their method's steps: to a Python step, into the model (alone
or batched), to their end; and settling after every event.

A Python step queues the instance for a Python task (``PythonQueue``). The model step makes
jobs: one per instance (``with_batch_dim=False``, or ``max_batch_size`` 1), or batches of
instances of several requests (see ``batching``). Settling flushes due batches, starts
Python tasks and starts queued jobs at the end of every event, after the event's own
publishes, so with several stages jobs pipeline.
"""

from __future__ import annotations

from shardserve.errors import ErrorCode, InferenceError
from shardserve.repo.signature import check_instance
from shardserve.wire.protocol import ErrorInfo, InstanceResult, TensorMap
from shardserve_scheduler.core import batching
from shardserve_scheduler.core.actions import Action
from shardserve_scheduler.core.batching import Piece
from shardserve_scheduler.core.jobs import Lane, RequestState
from shardserve_scheduler.core.lanes import Lanes
from shardserve_scheduler.core.methods import ModelStep, PythonStep
from shardserve_scheduler.core.open_requests import OpenRequests, alive_key
from shardserve_scheduler.core.pystages import Outcome
from shardserve_scheduler.core.python_queue import PythonQueue
from shardserve_scheduler.core.replies import Replies


class Progress:
    """Advancing instances; forming jobs from batches; starting what is ready."""

    def __init__(
        self, requests: OpenRequests, lanes: Lanes, replies: Replies, python: PythonQueue
    ) -> None:
        self._requests = requests
        self._lanes = lanes
        self._replies = replies
        self._python = python

    def advance(self, state: RequestState, index: int, now: float) -> list[Action]:
        """Move an instance on to its next step (or to its end)."""
        instance = state.instances[index]
        plan = state.call.method
        if instance.step == len(plan.steps):
            outputs = plan.method_outputs(instance.env, state.call.request.outputs)
            return self._replies.instance_done(state, index, InstanceResult(outputs=outputs), now)
        step = plan.steps[instance.step]
        if isinstance(step, PythonStep):
            self._python.wait(state, index, step)
            return []
        return self._enter_model(state, index, step, now)

    def python_outcome(
        self, state: RequestState, index: int, position: int, outcome: Outcome, now: float
    ) -> list[Action]:
        """A Python step's outputs (or error) for one instance: it moves on (or fails)."""
        if isinstance(outcome, ErrorInfo):
            return self._replies.fail_instance(state, index, outcome.code, outcome.message, now)
        instance = state.instances[index]
        step = state.call.method.steps[position]
        for j, tensor in enumerate(outcome):
            instance.env[(step.index, j)] = tensor
        instance.step += 1
        return self.advance(state, index, now)

    def settle(self, now: float) -> list[Action]:
        """After every event: flush due batches, start Python tasks, start queued jobs."""
        actions: list[Action] = []
        for lane in self._lanes.all():
            if lane.batcher is not None and lane.hungry:
                for pieces in lane.batcher.due(now):
                    actions += self._batch_job(lane, pieces, now)
        actions += self._python.start()
        for lane in self._lanes.all():
            actions += self._lanes.pump(lane, now)
        return actions

    def _enter_model(
        self, state: RequestState, index: int, step: ModelStep, now: float
    ) -> list[Action]:
        call, instance = state.call, state.instances[index]
        inputs = call.method.model_inputs(step, instance.env)
        lane = self._lanes.for_call(call)
        try:
            check_instance(inputs, call.group.inputs, batch_dim=call.group.with_batch_dim)
            rows = batching.rows_of(inputs, lane.no_batch) if lane.batcher is not None else 1
        except (InferenceError, ValueError) as exc:
            text = exc.message if isinstance(exc, InferenceError) else str(exc)
            message = f"stage {step.index} ({step.tag}) input: {text}"
            return self._replies.fail_instance(state, index, ErrorCode.BAD_INPUT, message, now)
        instance.where = "waiting for the model"
        if lane.batcher is None or (lane.stacking and not batching.stackable(inputs)):
            instance.chunks = [None]
            member = (state.key, index, 0, instance.step)
            self._lanes.queue_job(lane, [(member, inputs)], None, now)
            return []
        if lane.stacking:
            return self._stack(lane, state, index, inputs, now)
        return self._chunk(lane, state, index, inputs, rows, now)

    def _stack(
        self, lane: Lane, state: RequestState, index: int, inputs: TensorMap, now: float
    ) -> list[Action]:
        """The instance joins the lane's batcher whole, to be stacked with others."""
        state.instances[index].chunks = [None]
        member = (state.key, index, 0, state.instances[index].step)
        piece = Piece(member, inputs, 1, now, batching.stack_key(inputs))
        return self._add_piece(lane, piece, now)

    def _chunk(
        self,
        lane: Lane,
        state: RequestState,
        index: int,
        inputs: TensorMap,
        rows: int,
        now: float,
    ) -> list[Action]:
        """The instance joins the lane's batcher as rows, in chunks of at most the limit."""
        assert lane.batcher is not None
        instance = state.instances[index]
        pieces = batching.chunk(inputs, lane.no_batch, rows, lane.batcher.limit)
        instance.chunks = [None] * len(pieces)
        actions: list[Action] = []
        for c, part in enumerate(pieces):
            member = (state.key, index, c, instance.step)
            part_rows = rows if len(pieces) == 1 else batching.rows_of(part, lane.no_batch)
            key = batching.batch_key(part, lane.no_batch)
            actions += self._add_piece(lane, Piece(member, part, part_rows, now, key), now)
        return actions

    def _add_piece(self, lane: Lane, piece: Piece, now: float) -> list[Action]:
        """A piece joins the lane's batcher; each batch that fills leaves as one job."""
        assert lane.batcher is not None  # only a batching lane gets pieces
        actions: list[Action] = []
        for full in lane.batcher.add(piece):
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
                state = self._requests.alive(key, index, position)
                if state is not None:
                    doing = "while forming a batch"
                    actions += self._replies.fail_instance_after_bug(state, index, doing, exc, now)
            return actions

    def _form_job(self, lane: Lane, pieces: list[Piece], now: float) -> None:
        live = [p for p in pieces if self._requests.alive(*alive_key(p.member))]
        if not live:
            return
        if lane.stacking and len(live) > 1:
            inputs = batching.stack(live)
            self._lanes.queue_job(lane, [(p.member, inputs) for p in live], None, now, len(live))
            return
        if lane.stacking:  # one instance: a plain job
            self._lanes.queue_job(lane, [(live[0].member, live[0].inputs)], None, now)
            return
        inputs, ranges = batching.combine(live, lane.no_batch, lane.group.max_batch_size)
        self._lanes.queue_job(lane, [(p.member, inputs) for p in live], ranges, now)

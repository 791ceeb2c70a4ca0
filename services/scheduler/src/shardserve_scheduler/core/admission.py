"""Letting a resolved request in, or refusing it (deadline already passed, or overloaded).

In-flight jobs are bounded per servable version (``max_inflight``); beyond, jobs wait in
a FIFO of ``queue_factor * max_inflight`` (pieces being batched count as waiting);
beyond that, the request is refused OVERLOADED.
"""

from __future__ import annotations

from shardserve.errors import ErrorCode
from shardserve_scheduler.core.actions import Action, Reply, bug_log, bug_message, error_reply
from shardserve_scheduler.core.jobs import Call, Counters, InstanceState, Lane, RequestState
from shardserve_scheduler.core.lanes import Lanes
from shardserve_scheduler.core.open_requests import OpenRequests
from shardserve_scheduler.core.progress import Progress
from shardserve_scheduler.core.replies import Replies
from shardserve_scheduler.core.request_limits import RequestLimits
from shardserve_scheduler.core.statistics import Statistics


class Admission:
    """Admits requests: each instance starts its first step, or the request is refused."""

    def __init__(
        self,
        limits: RequestLimits,
        counters: Counters,
        statistics: Statistics,
        requests: OpenRequests,
        lanes: Lanes,
        replies: Replies,
        progress: Progress,
    ) -> None:
        self._limits = limits
        self._counters = counters
        self._statistics = statistics
        self._requests = requests
        self._lanes = lanes
        self._replies = replies
        self._progress = progress

    def admit(self, call: Call, now: float) -> list[Action]:
        """The request's instances start their first step, or its one refusal."""
        self._statistics.request(call.lane_key)
        refusal = self._refusal(call, now)
        if refusal is not None:
            self._statistics.error(call.lane_key)
            return [self._replies.count_reply(refusal)]
        self._counters.accepted += 1
        instances = [InstanceState(call.method.start_env(i)) for i in call.request.instances]
        state = self._requests.open(call, now, instances)
        actions: list[Action] = []
        try:
            for index in range(len(instances)):
                actions += self._progress.advance(state, index, now)
            return actions
        except Exception as exc:  # a scheduler bug: this request fails loudly, others go on
            return actions + self._fail_after_bug(state, exc, now)

    def _refusal(self, call: Call, now: float) -> Reply | None:
        request = call.request
        code, message = None, ""
        if request.deadline <= now:
            code = ErrorCode.DEADLINE
            message = "deadline already passed when the scheduler received the request"
        else:
            lane = self._lanes.for_call(call)
            limits = self._limits.max_inflight + self._limits.max_queued
            room = limits - len(lane.inflight) - lane.waiting
            if len(request.instances) > room:
                self._counters.overloaded += 1
                code = ErrorCode.OVERLOADED
                message = self._overload_message(call, lane)
        if code is None:
            return None
        return error_reply(
            request, call.reply_to, call.correlation_id, code, message, version=call.group.version
        )

    def _overload_message(self, call: Call, lane: Lane) -> str:
        # Instances being batched take a place each (each could end up a job of its own),
        # so a batching servable can be full with few jobs: the message says which.
        batching = len(lane.batcher) if lane.batcher is not None else 0
        held = f", {batching} instance(s) being batched" if batching else ""
        limit = self._limits.max_inflight
        return (
            f"servable {call.request.servable} is overloaded: {len(lane.inflight)} jobs in "
            f"flight, {len(lane.queued)} queued{held} (at most {limit} in flight "
            f"and {self._limits.max_queued} waiting: --max-inflight {limit})"
        )

    def _fail_after_bug(self, state: RequestState, exc: Exception, now: float) -> list[Action]:
        """The request whose admission raised gets an INTERNAL error now instead of waiting
        for its deadline (and the rest of its bundle is still admitted); the traceback is
        logged."""
        message = bug_message("while admitting the request", exc)
        log = bug_log(message, state.call.request.id)
        if not self._requests.is_open(state):  # it already had its one outcome
            return [log]
        try:
            return [log, *self._replies.fail_request(state, ErrorCode.INTERNAL, message, now)]
        except Exception:
            return [log, *self._replies.abandon(state, message)]

"""Ending instances and requests: exactly one Reply per request.

Each instance has its own outcome (InstanceResult); when every instance failed with the
same error the reply carries that one error instead, as MindSpore does. Ending an instance
or a request drops the jobs that no open instance needs any more (``Lanes.prune``).

A bug (an unexpected exception) while handling one instance or request ends that one
with an INTERNAL error naming it (``fail_instance_after_bug``, ``abandon``); the rest of
the event goes on, so no reply already made is lost and none is left for the deadline.
"""

from __future__ import annotations

import logging

from shardserve.errors import ErrorCode
from shardserve.wire.protocol import ErrorInfo, InferReply, InstanceResult
from shardserve_scheduler.core.actions import Action, Log, Reply, bug_log, bug_message, error_reply
from shardserve_scheduler.core.jobs import Counters, RequestState, collapsed_error
from shardserve_scheduler.core.lanes import Lanes
from shardserve_scheduler.core.open_requests import OpenRequests
from shardserve_scheduler.core.statistics import Statistics


class Replies:
    """Instance and request outcomes, and the one reply each request gets."""

    def __init__(
        self, counters: Counters, statistics: Statistics, requests: OpenRequests, lanes: Lanes
    ) -> None:
        self._counters = counters
        self._statistics = statistics
        self._requests = requests
        self._lanes = lanes

    def instance_done(
        self, state: RequestState, index: int, result: InstanceResult, now: float
    ) -> list[Action]:
        state.instances[index].outcome = result
        state.instances[index].chunks = []
        if state.open_instances:
            return []
        return self._reply(state, now)

    def fail_instance(
        self, state: RequestState, index: int, code: ErrorCode, message: str, now: float
    ) -> list[Action]:
        result = InstanceResult(error=ErrorInfo(code=code, message=message))
        state.instances[index].outcome = result
        state.instances[index].chunks = []
        prefix = f"instance {index} " if len(state.instances) > 1 else "request "
        level = logging.INFO if code == ErrorCode.BAD_INPUT else logging.WARNING
        actions: list[Action] = [
            Log(level, f"{prefix}failed ({code.value}): {message}", state.call.request.id)
        ]
        actions += self._lanes.prune(state, now)
        if not state.open_instances:
            actions += self._reply(state, now)
        return actions

    def fail_open_instances(
        self, state: RequestState, code: ErrorCode, message: str, now: float
    ) -> list[Action]:
        """Fail every instance of ``state`` without an outcome (finished ones keep theirs)."""
        actions: list[Action] = []
        for index, instance in enumerate(state.instances):
            if instance.outcome is None and self._requests.is_open(state):
                actions += self.fail_instance(state, index, code, message, now)
        return actions

    def fail_request(
        self, state: RequestState, code: ErrorCode, message: str, now: float
    ) -> list[Action]:
        """Reply one error to a whole request and drop every job only it still needs."""
        call = state.call
        reply = error_reply(
            call.request,
            call.reply_to,
            call.correlation_id,
            code,
            message,
            version=call.group.version,
        )
        level = (
            logging.INFO if code in (ErrorCode.DEADLINE, ErrorCode.UNAVAILABLE) else logging.WARNING
        )
        self._close(state, failed=True)
        actions: list[Action] = [
            self.count_reply(reply),
            Log(level, f"request failed ({code.value}): {message}", call.request.id),
        ]
        return actions + self._lanes.prune(state, now)

    def fail_instance_after_bug(
        self, state: RequestState, index: int, doing: str, exc: Exception, now: float
    ) -> list[Action]:
        """Handling one instance raised (a bug): it fails INTERNAL now, the traceback is
        logged, and the caller goes on with the other instances of its event."""
        message = bug_message(doing, exc)
        log = bug_log(message, state.call.request.id)
        if not self._requests.is_open(state) or state.instances[index].outcome is not None:
            return [log]  # it already has its outcome
        try:
            return [log, *self.fail_instance(state, index, ErrorCode.INTERNAL, message, now)]
        except Exception:
            return [log, *self.abandon(state, message)]

    def abandon_after_bug(self, state: RequestState, doing: str, exc: Exception) -> list[Action]:
        """Ending ``state`` the regular way raised: it is answered INTERNAL all the same."""
        message = bug_message(doing, exc)
        return [bug_log(message, state.call.request.id), *self.abandon(state, message)]

    def abandon(self, state: RequestState, message: str) -> list[Action]:
        """The last resort when ending a request the regular way raised: forget it and
        reply INTERNAL ``message``. Jobs that only it needed finish unseen."""
        if not self._requests.is_open(state):
            return []
        call = state.call
        self._close(state, failed=True)
        reply = error_reply(
            call.request,
            call.reply_to,
            call.correlation_id,
            ErrorCode.INTERNAL,
            message,
            version=call.group.version,
        )
        return [self.count_reply(reply)]

    def count_reply(self, reply: Reply) -> Reply:
        self._counters.replied += 1
        return reply

    def _reply(self, state: RequestState, now: float) -> list[Action]:
        call = state.call
        results = [i.outcome for i in state.instances if i.outcome is not None]
        error = collapsed_error(results)
        reply = InferReply(
            id=call.request.id,
            servable=call.group.servable,
            version=call.group.version,
            method=call.request.method,
            instances=() if error else tuple(results),
            error=error,
        )
        failed = any(r.error is not None for r in results)
        self._close(state, failed)
        return [self.count_reply(Reply(call.reply_to, call.correlation_id, reply))]

    def _close(self, state: RequestState, failed: bool) -> None:
        self._requests.close(state)
        if failed:
            self._counters.failed += 1
            self._statistics.error(state.call.lane_key)
        else:
            self._counters.succeeded += 1

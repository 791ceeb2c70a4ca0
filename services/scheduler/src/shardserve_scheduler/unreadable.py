"""A request whose body does not decode is answered, not only dead-lettered.

The decoder refuses what the wire's bounds refuse (``shardserve.wire.bounds``: a string
past its byte limit, an array past its item limit, a NaN, an id >= 2**31...). The gateway
refuses all that with a 400 before publishing, but a queue-level client publishes bodies
itself: before, such a body was dead-lettered and its sender waited for its deadline.
Its AMQP properties survive a body that cannot be read, so when they say where to answer
(``reply_to``, ``correlation_id``) and what was sent (``type``: ``generate.request`` or
``infer.request``, as ``Broker.publish`` sets it) the sender gets the decoder's reason as a
``bad_input`` answer of that kind: a one-chunk stream, or an InferReply. The body is still
dead-lettered (kept to be looked at). Without those properties there is nobody to answer.
"""

from __future__ import annotations

from shardserve.errors import ErrorCode
from shardserve.wire.protocol import (
    ErrorInfo,
    GenerateChunk,
    GenerateRequest,
    InferReply,
    InferRequest,
)
from shardserve_scheduler.core.actions import Reply, SendChunk

GENERATE_KIND = GenerateRequest.model_fields["kind"].default
INFER_KIND = InferRequest.model_fields["kind"].default


def answer_unreadable(
    reply_to: str | None, correlation_id: str | None, message_type: str | None, problem: str
) -> SendChunk | Reply | None:
    """The answer to an undecodable request (None: nobody to answer, or not a request)."""
    if not reply_to or not correlation_id:
        return None
    error = ErrorInfo(code=ErrorCode.BAD_INPUT, message=f"the request cannot be read: {problem}")
    if message_type == GENERATE_KIND:
        chunk = GenerateChunk(id=correlation_id, seq=0, error=error)
        return SendChunk(reply_to, correlation_id, chunk)
    if message_type == INFER_KIND:
        reply = InferReply(id=correlation_id, servable="", error=error)
        return Reply(reply_to, correlation_id, reply)
    return None

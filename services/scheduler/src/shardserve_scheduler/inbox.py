"""The request queue of the other type: unbound when no scheduler consumes it.

A scheduler binds the request queue of its ``--request-queue`` type (classic or quorum;
each has its own name). A queue of the other type still bound to the requests exchange,
left by an earlier version (whose only type was quorum) or an earlier setting, gets a copy
of every request. With no consumer it fills up to its bound, and from then on the broker
refuses every publish: every request would get a 503. So when a scheduler becomes active
it unbinds that queue if nobody consumes it, and reports it if a scheduler does (the
schedulers of one mesh disagree on the type: each request reaches both).
"""

from __future__ import annotations

import logging

from shardserve.amqp.broker import Broker
from shardserve.errors import UnavailableError
from shardserve.wire import topology

_logger = logging.getLogger(__name__)


def other_type(kind: topology.RequestQueueType) -> topology.RequestQueueType:
    return "quorum" if kind == "classic" else "classic"


async def unbind_other_request_queue(broker: Broker, kind: topology.RequestQueueType) -> bool:
    """Unbind the other type's request queue if it exists and has no consumer; True if
    it was unbound. Never raises: the broker's trouble is logged, serving goes on."""
    other = topology.request_queue_name(other_type(kind))
    try:
        state = await broker.queue_state(other)
        if state is None:
            return False
        if state.consumers:
            _logger.error(
                "%d consumer(s) on %s: a scheduler of this mesh runs with --request-queue "
                "%s, this one with %s; every request reaches both queues. Give every "
                "scheduler the same type.",
                state.consumers,
                other,
                other_type(kind),
                kind,
            )
            return False
        await broker.unbind(topology.request_binding(other_type(kind)))
    except UnavailableError as exc:
        _logger.warning("could not check for a request queue of the other type: %s", exc)
        return False
    _logger.warning(
        "unbound %s from %s: a request queue of the other type (%s) that nobody consumes "
        "(%d message(s) left in it; delete it when no gateway waits for them)",
        other,
        topology.REQUESTS_EXCHANGE,
        other_type(kind),
        state.ready,
    )
    return True

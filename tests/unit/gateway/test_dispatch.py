"""AmqpDispatcher logic with a stand-in broker: futures per correlation id, deadline,
late replies, publish failures. (The real broker is exercised in the integration test.)"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from shardserve.errors import DeadlineError, OverloadedError, UnavailableError
from shardserve.wire import topology
from shardserve.wire.protocol import InferReply, InferRequest, MeshStatus
from shardserve.wire.tensors import Tensor
from shardserve_gateway.dispatch import AmqpDispatcher, choose_timeout


@dataclass
class Incoming:
    correlation_id: str | None


@dataclass
class StandInBroker:
    healthy: bool = True
    fail_with: Exception | None = None
    published: list[dict[str, Any]] = field(default_factory=list)
    handler: Any = None
    sent: asyncio.Event = field(default_factory=asyncio.Event)

    async def declare(self, queue: topology.Queue, bindings: tuple[Any, ...] = ()) -> None:
        self.declared = queue

    async def consume(self, queue: str, handler: Any, *, prefetch: int, no_ack: bool) -> str:
        self.handler, self.prefetch, self.no_ack = handler, prefetch, no_ack
        return "ctag"

    def add_state_listener(self, listener: Any) -> None:
        self.state_listener = listener

    def lose_connection(self) -> None:
        self.healthy = False
        self.state_listener(False)

    async def publish(self, exchange: str, key: str, message: Any, **props: Any) -> None:
        if self.fail_with is not None:
            raise self.fail_with
        self.published.append({"exchange": exchange, "key": key, "message": message, **props})
        self.sent.set()


def request(timeout: float = 5.0) -> InferRequest:
    x = Tensor(dtype="<f4", shape=(1,), data=b"\0\0\0\0")
    return InferRequest(
        id="user-id", servable="matmul", instances=({"x": x},), deadline=time.time() + timeout
    )


async def started(broker: StandInBroker) -> AmqpDispatcher:
    dispatcher = AmqpDispatcher(broker, "gw-1")  # type: ignore[arg-type]
    await dispatcher.start()
    return dispatcher


async def test_reply_resolves_the_waiting_request() -> None:
    broker = StandInBroker()
    dispatcher = await started(broker)
    assert broker.declared == topology.reply_queue("gw-1")
    assert broker.prefetch == 256
    assert broker.no_ack is True  # exclusive reply queue: nothing to redeliver
    call = asyncio.create_task(dispatcher.call(request()))
    await broker.sent.wait()
    sent = broker.published[0]
    assert (sent["exchange"], sent["key"]) == (topology.REQUESTS_EXCHANGE, "matmul")
    assert sent["reply_to"] == "shardserve.reply.gw-1"
    assert sent["confirm"] is True
    assert sent["correlation_id"] != "user-id"  # unique per HTTP request, not the user's id
    reply = InferReply(id="user-id", servable="matmul")
    await broker.handler(reply, Incoming(sent["correlation_id"]))
    assert await call == reply
    assert dispatcher.inflight == 0


async def test_no_reply_raises_deadline_and_late_reply_is_dropped() -> None:
    broker = StandInBroker()
    dispatcher = await started(broker)
    with pytest.raises(DeadlineError, match="deadline exceeded"):
        await dispatcher.call(request(timeout=0.05))
    late = broker.published[0]["correlation_id"]
    await broker.handler(InferReply(id="user-id", servable="matmul"), Incoming(late))
    assert dispatcher.late_replies == 1
    assert dispatcher.inflight == 0


async def test_expired_deadline_is_not_published() -> None:
    broker = StandInBroker()
    dispatcher = await started(broker)
    with pytest.raises(DeadlineError):
        await dispatcher.call(request(timeout=-1))
    assert broker.published == []


@pytest.mark.parametrize(
    ("failure", "healthy", "error", "message"),
    [
        (OverloadedError("queue is full"), True, OverloadedError, "overloaded: queue is full"),
        (UnavailableError("no queue takes it"), True, UnavailableError, "scheduler not running"),
        (UnavailableError("x"), False, UnavailableError, "message broker is unreachable"),
    ],
)
async def test_publish_failures(
    failure: Exception, healthy: bool, error: type[Exception], message: str
) -> None:
    broker = StandInBroker(fail_with=failure)
    dispatcher = await started(broker)
    broker.healthy = healthy
    if not healthy:
        broker.healthy = True  # healthy at the check, lost during the publish
        original = broker.publish

        async def lose_then_fail(*args: Any, **kwargs: Any) -> None:
            broker.healthy = False
            await original(*args, **kwargs)

        broker.publish = lose_then_fail  # type: ignore[method-assign]
    with pytest.raises(error, match=message):
        await dispatcher.call(request())
    assert dispatcher.inflight == 0


async def test_broker_down_fails_at_once_and_close_fails_waiters() -> None:
    broker = StandInBroker(healthy=False)
    dispatcher = await started(broker)
    with pytest.raises(UnavailableError, match="unreachable"):
        await dispatcher.call(request())
    broker.healthy = True
    call = asyncio.create_task(dispatcher.call(request()))
    await broker.sent.wait()
    await dispatcher.close()
    with pytest.raises(UnavailableError, match="shutting down"):
        await call
    assert not dispatcher.available


async def test_unexpected_message_on_reply_queue_fails_the_request() -> None:
    broker = StandInBroker()
    dispatcher = await started(broker)
    call = asyncio.create_task(dispatcher.call(request()))
    await broker.sent.wait()
    status = MeshStatus(scheduler="s", time=0.0, servables=())
    await broker.handler(status, Incoming(broker.published[0]["correlation_id"]))
    with pytest.raises(Exception, match="unexpected mesh.status"):
        await call


def test_choose_timeout() -> None:
    assert choose_timeout(None, None, default_s=30, max_s=300) == 30
    assert choose_timeout("2.5", 100, default_s=30, max_s=300) == 2.5  # header wins
    assert choose_timeout(None, 1500, default_s=30, max_s=300) == 1.5
    assert choose_timeout("1e9", None, default_s=30, max_s=300) == 300
    for bad in ("x", "0", "-2", "inf"):
        with pytest.raises(Exception, match="X-Request-Timeout|positive"):
            choose_timeout(bad, None, default_s=30, max_s=300)
    with pytest.raises(Exception, match="timeout_ms"):
        choose_timeout(None, "soon", default_s=30, max_s=300)


async def test_requests_beyond_the_inflight_limit_are_refused_at_once() -> None:
    """A flood is answered 503 (overloaded) immediately instead of queueing to its deadline."""
    broker = StandInBroker()
    dispatcher = AmqpDispatcher(broker, "gw-1", max_inflight=2)  # type: ignore[arg-type]
    await dispatcher.start()
    waiting = [asyncio.create_task(dispatcher.call(request())) for _ in range(2)]
    for _ in range(1000):  # let both calls reach their publish
        if len(broker.published) >= 2:
            break
        await asyncio.sleep(0)
    with pytest.raises(OverloadedError, match="2 requests in flight"):
        await dispatcher.call(request())
    assert dispatcher.refused_overload == 1
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    assert dispatcher.inflight == 0

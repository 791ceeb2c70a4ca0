"""Replies that can never come fail at once: scheduler restart, broker connection lost.
Messages are injected the way the status consumer feeds them (``on_status_message``)."""

from __future__ import annotations

import asyncio

import pytest
from test_dispatch import Incoming, StandInBroker, request, started

from shardserve.errors import UnavailableError
from shardserve.wire import topology
from shardserve.wire.protocol import InferReply, MeshStatus, RepositoryCommand, SchedulerHello
from shardserve_gateway.dispatch import AmqpDispatcher
from shardserve_gateway.mesh_view import MeshView, on_status_message


def status_from(scheduler: str) -> MeshStatus:
    return MeshStatus(scheduler=scheduler, time=0.0, servables=())


async def wired() -> tuple[StandInBroker, AmqpDispatcher, MeshView]:
    broker = StandInBroker()
    dispatcher = await started(broker)
    view = MeshView()
    view.add_scheduler_listener(dispatcher.scheduler_seen)
    return broker, dispatcher, view


async def in_flight(
    broker: StandInBroker, dispatcher: AmqpDispatcher
) -> tuple[asyncio.Task[InferReply], str]:
    broker.sent.clear()
    call = asyncio.create_task(dispatcher.call(request(timeout=30)))
    await broker.sent.wait()
    return call, broker.published[-1]["correlation_id"]


@pytest.mark.parametrize(
    "restart",
    [SchedulerHello(scheduler="sched-B"), status_from("sched-B")],
    ids=["hello", "status"],
)
async def test_new_scheduler_fails_requests_the_old_one_took(
    restart: SchedulerHello | MeshStatus,
) -> None:
    broker, dispatcher, view = await wired()
    on_status_message(view, status_from("sched-A"))
    call, _ = await in_flight(broker, dispatcher)
    on_status_message(view, status_from("sched-A"))  # same scheduler: nothing happens
    assert not call.done()
    on_status_message(view, restart)
    with pytest.raises(UnavailableError, match="scheduler restarted; request was in flight"):
        await asyncio.wait_for(call, 1.0)
    assert dispatcher.failed_early == 1
    assert dispatcher.inflight == 0


async def test_requests_sent_to_the_new_scheduler_are_kept() -> None:
    broker, dispatcher, view = await wired()
    on_status_message(view, status_from("sched-A"))
    on_status_message(view, SchedulerHello(scheduler="sched-B"))
    call, correlation_id = await in_flight(broker, dispatcher)
    on_status_message(view, status_from("sched-B"))  # B's status after its hello
    reply = InferReply(id="user-id", servable="matmul")
    await broker.handler(reply, Incoming(correlation_id))
    assert await call == reply


async def test_first_scheduler_seen_does_not_fail_earlier_requests() -> None:
    # Sent before any status arrived (gateway just started): the running scheduler has it.
    broker, dispatcher, view = await wired()
    call, correlation_id = await in_flight(broker, dispatcher)
    on_status_message(view, status_from("sched-A"))
    assert not call.done()
    await broker.handler(InferReply(id="user-id", servable="matmul"), Incoming(correlation_id))
    assert (await call).servable == "matmul"


async def test_broker_loss_fails_pending_at_once_and_refuses_new_requests() -> None:
    broker, dispatcher, _ = await wired()
    first, _ = await in_flight(broker, dispatcher)
    second, _ = await in_flight(broker, dispatcher)
    broker.lose_connection()
    for call in (first, second):
        with pytest.raises(UnavailableError, match="broker connection lost"):
            await asyncio.wait_for(call, 1.0)
    assert not dispatcher.available
    with pytest.raises(UnavailableError, match="message broker is unreachable"):
        await dispatcher.call(request())
    dispatcher.connection_changed(True)  # restored: nothing to fail, calls go out again
    broker.healthy = True
    call, correlation_id = await in_flight(broker, dispatcher)
    await broker.handler(InferReply(id="user-id", servable="matmul"), Incoming(correlation_id))
    assert (await call).servable == "matmul"


async def test_repository_command_is_published_confirmed_to_the_scheduler() -> None:
    broker, dispatcher, _ = await wired()
    command = RepositoryCommand(action="unload", servable="matmul", version=2)
    await dispatcher.command(command)
    sent = broker.published[-1]
    assert (sent["exchange"], sent["key"]) == (
        topology.CONTROL_EXCHANGE,
        topology.KEY_SCHEDULER_COMMAND,
    )
    assert sent["message"] == command
    assert sent["confirm"] is True


async def test_repository_command_without_a_scheduler_is_503() -> None:
    broker, dispatcher, _ = await wired()
    broker.fail_with = UnavailableError("no queue takes shardserve.control:scheduler.command")
    with pytest.raises(UnavailableError, match="scheduler not running"):
        await dispatcher.command(RepositoryCommand(action="load", servable="matmul"))


async def test_waiting_for_the_first_status_ends_when_one_arrives_or_at_the_bound() -> None:
    view = MeshView()
    assert await view.wait_first_status(0.01) is False
    waiting = asyncio.create_task(view.wait_first_status(30))
    await asyncio.sleep(0)
    assert not waiting.done()
    view.update(status_from("sched-a"))
    assert await waiting is True
    assert await view.wait_first_status(0) is True  # already known: no wait at all

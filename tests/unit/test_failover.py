"""Broker failover: the hook into aio-pika's one reconnect path, and URL rotation."""

from __future__ import annotations

import asyncio

from aio_pika.robust_connection import RobustConnection

from shardserve.amqp.failover import ATTEMPT_HOOK, FailoverConnection
from shardserve.wire import topology


def test_aio_pika_still_has_the_per_attempt_hook() -> None:
    # If an upgrade renames it, failover would silently stick to one broker.
    assert callable(getattr(RobustConnection, ATTEMPT_HOOK))
    assert ATTEMPT_HOOK in FailoverConnection.__dict__


async def test_each_failed_attempt_moves_to_the_next_url() -> None:
    urls = [
        "amqp://u:p@127.0.0.1:1/?heartbeat=5",
        "amqps://u:p@127.0.0.2:2/?heartbeat=7",
        "amqp://u:p@127.0.0.3:3/",
    ]
    connection = FailoverConnection(urls, start=1, reconnect_interval=0.01)
    seen = [connection.url.port]
    for _ in range(3):
        connection._advance()
        seen.append(connection.url.port)
    assert seen == [2, 3, 1, 2]
    assert "reconnect_interval" not in connection.kwargs
    assert connection.reconnect_interval == 0.01
    assert "***" in connection.current_url and ":p@" not in connection.current_url
    await asyncio.sleep(0)


def test_request_and_leader_queues_are_single_active_consumer() -> None:
    queues = (topology.request_queue(), topology.request_queue("quorum"))
    for queue in (*queues, topology.scheduler_leader_queue()):
        assert not queue.exclusive and not queue.auto_delete
        assert queue.arguments["x-single-active-consumer"] is True
    for request in queues:
        assert request.arguments["x-overflow"] == "reject-publish"
        assert request.arguments["x-max-length"] > 0
        assert request.name != topology.REQUESTS_EXCHANGE


def test_quorum_queues_are_durable_and_the_classic_request_queue_transient() -> None:
    for queue in (topology.request_queue("quorum"), topology.scheduler_leader_queue()):
        assert queue.durable and queue.arguments["x-queue-type"] == "quorum"
    classic = topology.request_queue()
    assert not classic.durable and "x-queue-type" not in classic.arguments
    # RabbitMQ refuses to redeclare a queue with another type: each type has its own name
    assert classic.name != topology.request_queue("quorum").name


def test_the_scheduler_binds_the_request_queue_of_its_type() -> None:
    for kind in topology.REQUEST_QUEUE_TYPES:
        bound = {b.queue for b in topology.scheduler_bindings("a", kind)}
        assert topology.request_queue(kind).name in bound
        other = "quorum" if kind == "classic" else "classic"
        assert topology.request_queue(other).name not in bound


def test_each_scheduler_has_its_own_control_and_result_queue() -> None:
    a, b = topology.scheduler_control_queue("a"), topology.scheduler_control_queue("b")
    assert a.name != b.name and a.exclusive and a.auto_delete
    assert {x.queue for x in topology.scheduler_bindings("a")} >= {a.name}
    assert topology.scheduler_result_queue("a").name != topology.scheduler_result_queue("b").name

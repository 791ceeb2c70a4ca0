"""deploy/rabbitmq/definitions.json on a real RabbitMQ: each service's user can do what the
service does (declare, bind, consume, publish, per topology.py) and is refused another
service's resources. Users and a vhost are made per module with rabbitmqctl."""

from __future__ import annotations

import json
import shutil
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import quote, urlsplit

import pytest

from shardserve.amqp.broker import Broker
from shardserve.errors import UnavailableError
from shardserve.process.settings import BrokerSettings
from shardserve.wire import topology

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
DEFINITIONS = json.loads((ROOT / "deploy" / "rabbitmq" / "definitions.json").read_text())
ROLES = ("gateway", "scheduler", "agent")


def ctl(*args: str) -> None:
    subprocess.run(["rabbitmqctl", "-q", *args], check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def role_urls(amqp_url: str) -> Iterator[dict[str, str]]:
    parts = urlsplit(amqp_url)
    if shutil.which("rabbitmqctl") is None or parts.hostname not in ("127.0.0.1", "localhost"):
        pytest.skip("needs rabbitmqctl for a local broker to create users and a vhost")
    tag = uuid.uuid4().hex[:8]
    vhost = f"shardserve-perm-{tag}"
    ctl("add_vhost", vhost)
    users = {}
    try:
        for entry in DEFINITIONS["permissions"]:
            user = f"{entry['user']}-{tag}"
            ctl("add_user", user, "pw")
            users[entry["user"]] = user
            ctl("set_permissions", "-p", vhost, user,
                entry["configure"], entry["write"], entry["read"])  # fmt: skip
        host = f"{parts.hostname}:{parts.port or 5672}"
        yield {role: f"amqp://{user}:pw@{host}/{quote(vhost, safe='')}"
               for role, user in users.items()}  # fmt: skip
    finally:
        for user in users.values():
            ctl("delete_user", user)
        ctl("delete_vhost", vhost)


async def _noop(*_: object) -> None:
    return None


async def connected(url: str, name: str) -> Broker:
    broker = Broker(BrokerSettings(urls=(url,)), name)
    await broker.connect()
    return broker


@pytest.fixture
async def brokers(role_urls: dict[str, str]) -> AsyncIterator[dict[str, Broker]]:
    opened: dict[str, Broker] = {}
    try:
        for role in ROLES:
            opened[role] = await connected(role_urls[role], f"perm-{role}")
        yield opened
    finally:
        for broker in reversed(opened.values()):
            await broker.close()


async def test_each_service_user_can_do_its_job(brokers: dict[str, Broker]) -> None:
    scheduler, gateway, agent = brokers["scheduler"], brokers["gateway"], brokers["agent"]
    # scheduler: its queues, bindings and consumers
    bindings = topology.scheduler_bindings("s1")
    for queue in (topology.request_queue(), topology.request_queue("quorum"),
                  topology.scheduler_control_queue("s1"),
                  topology.scheduler_result_queue("s1"), topology.dead_letter_queue(),
                  topology.scheduler_leader_queue()):  # fmt: skip
        await scheduler.declare(queue, bindings)
        await scheduler.consume(queue.name, _noop, prefetch=1)
    # gateway: reply and status queues, then a request reaches the scheduler's queue
    reply, status = topology.reply_queue("gw1"), topology.status_queue("gw1")
    await gateway.declare(reply)
    await gateway.declare(status, topology.status_bindings("gw1"))
    for queue in (reply, status):
        await gateway.consume(queue.name, _noop, prefetch=1)
    await gateway.publish_raw(topology.REQUESTS_EXCHANGE, "matmul", b"req", confirm=True)
    # agent: its three queues, then every publish it makes is routed
    agent_bindings = topology.agent_bindings("matmul", 1, 0, 0, "a1")
    for queue in (topology.agent_work_queue("matmul", 1, 0),
                  topology.agent_collective_queue("matmul", 1, 0),
                  topology.agent_control_queue("a1")):  # fmt: skip
        await agent.declare(queue, agent_bindings)
        await agent.consume(queue.name, _noop, prefetch=1)
    key = topology.stage_key("matmul", 1, 0)
    await agent.publish_raw(topology.COLLECTIVE_EXCHANGE, key, b"part", confirm=True)
    await agent.publish_raw(topology.CONTROL_EXCHANGE, topology.KEY_AGENT_HELLO, b"hi",
                            confirm=True)  # fmt: skip
    result_queue = topology.scheduler_result_queue("s1").name
    await agent.publish_raw("", result_queue, b"result", confirm=True)
    # scheduler: stage work to the agents, control to them, a reply to the gateway
    await scheduler.publish_raw(topology.STAGE_EXCHANGE, key, b"work", confirm=True)
    await scheduler.publish_raw(topology.CONTROL_EXCHANGE, topology.KEY_SCHEDULER_STATUS,
                                b"status", confirm=True)  # fmt: skip
    await scheduler.publish_raw("", reply.name, b"reply", confirm=True)
    await scheduler.publish_raw("", topology.SCHEDULER_LEADER_QUEUE, b"token", confirm=True)


@pytest.mark.parametrize(
    ("role", "exchange", "key"),
    [
        ("agent", topology.REQUESTS_EXCHANGE, "matmul"),
        ("agent", topology.STAGE_EXCHANGE, "matmul.1.s0"),
        ("gateway", topology.STAGE_EXCHANGE, "matmul.1.s0"),
        ("gateway", "", topology.scheduler_result_queue("s1").name),
    ],
)
async def test_publishing_outside_the_role_is_refused(
    role_urls: dict[str, str], role: str, exchange: str, key: str
) -> None:
    broker = await connected(role_urls[role], f"perm-deny-{role}")
    try:
        with pytest.raises(UnavailableError, match="ACCESS_REFUSED"):
            await broker.publish_raw(exchange, key, b"x", confirm=True)
    finally:
        await broker.close()


async def test_reading_another_services_queue_is_refused(role_urls: dict[str, str]) -> None:
    scheduler = await connected(role_urls["scheduler"], "perm-owner")
    agent = await connected(role_urls["agent"], "perm-thief")
    try:
        await scheduler.declare(topology.request_queue(), topology.scheduler_bindings("s1"))
        with pytest.raises(Exception, match="ACCESS_REFUSED"):
            await agent.consume(topology.REQUEST_QUEUE, _noop, prefetch=1)
    finally:
        await agent.close()
        await scheduler.close()

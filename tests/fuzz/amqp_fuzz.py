"""Bad messages published straight into every queue a service of the mesh consumes.

The consumer queues are found on the mesh's vhost (``rabbitmqctl list_queues``) and grouped
by role (``QUEUE_ROLES``). Each bad message carries a ``message_id`` with this run's marker
and must come back on ``shardserve.dead-letters``, whatever queue it was sent to (the broker
moves it there from a queue with a dead-letter exchange; ``Broker`` republishes it from a
no-ack queue or one without that exchange). Every queue must keep its consumers.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aio_pika
from aio_pika.abc import AbstractIncomingMessage
from tests.fuzz.amqp_messages import BadMessage

from shardserve.ops.child_mesh import rabbitmqctl
from shardserve.wire import topology

# Queue name prefix -> role. The leadership token queue is left out: its messages are not
# decoded (any message is a token), so there is no bad input for it.
QUEUE_ROLES = {
    topology.REQUEST_QUEUE: "request",
    topology.QUORUM_REQUEST_QUEUE: "request",
    "shardserve.agent.": "stage-work",
    "shardserve.coll.": "collective",
    "shardserve.agentctl.": "agent-control",
    topology.SCHEDULER_CONTROL_QUEUE + ".": "scheduler-control",
    topology.SCHEDULER_RESULT_QUEUE + ".": "scheduler-results",
    "shardserve.reply.": "gateway-replies",
    "shardserve.status.": "gateway-status",
}
PUBLISH_WINDOW = 200  # confirms awaited together
LISTING_ATTEMPTS = 3


@dataclass(frozen=True)
class ConsumerQueue:
    name: str
    role: str
    consumers: int
    depth: int  # messages waiting


@dataclass
class AmqpTally:
    marker: str = field(default_factory=lambda: f"fuzz-{uuid.uuid4().hex[:8]}")
    sent_by_role: Counter[str] = field(default_factory=Counter)
    labels: Counter[str] = field(default_factory=Counter)
    expected_dead: set[str] = field(default_factory=set)
    target_of: dict[str, str] = field(default_factory=dict)  # message id -> role
    seen_dead: set[str] = field(default_factory=set)
    refused_publishes: int = 0  # nacked by the broker (a full queue): never reached a consumer
    problems: list[str] = field(default_factory=list)

    @property
    def sent(self) -> int:
        return sum(self.sent_by_role.values())

    @property
    def missing_dead(self) -> int:
        return len(self.expected_dead - self.seen_dead)

    def missing_by_role(self) -> dict[str, int]:
        return dict(Counter(self.target_of[m] for m in self.expected_dead - self.seen_dead))

    @property
    def passed(self) -> bool:
        return self.sent > 0 and self.missing_dead == 0 and not self.problems

    def as_dict(self) -> dict[str, Any]:
        return {
            "sent": self.sent,
            "sent_by_role": dict(self.sent_by_role),
            "labels": dict(self.labels.most_common()),
            "dead_letters_expected": len(self.expected_dead),
            "dead_letters_seen": len(self.seen_dead & self.expected_dead),
            "dead_letters_missing_by_role": self.missing_by_role(),
            "refused_publishes": self.refused_publishes,
            "problems": self.problems,
            "passed": self.passed,
        }

    def summary(self) -> str:
        roles = " ".join(f"{k}:{v}" for k, v in sorted(self.sent_by_role.items()))
        return (
            f"amqp: sent {self.sent} ({roles}); dead letters expected "
            f"{len(self.expected_dead)}, seen {len(self.seen_dead & self.expected_dead)}; "
            f"broker refused {self.refused_publishes}; problems {len(self.problems)}"
        )


def role_of(queue: str) -> str | None:
    return next((role for prefix, role in QUEUE_ROLES.items() if queue.startswith(prefix)), None)


def consumer_queues(vhost: str) -> list[ConsumerQueue]:
    """The queues of ``vhost`` that a service consumes, by role."""
    columns = ("name", "consumers", "messages", "arguments")
    done = listed("list_queues", "-p", vhost, "--no-table-headers", *columns)
    if done.returncode != 0:
        raise RuntimeError(f"rabbitmqctl list_queues failed: {done.stderr.strip()}")
    found = []
    for line in done.stdout.splitlines():
        name, consumers, depth, arguments = (line.split("\t") + ["", "", ""])[:4]
        role = role_of(name)
        if role is not None and consumers.isdecimal() and int(consumers) > 0:
            depth_n = int(depth) if depth.isdecimal() else 0
            found.append(ConsumerQueue(name, role, int(consumers), depth_n))
    return sorted(found, key=lambda q: q.name)


def listed(*args: str) -> subprocess.CompletedProcess[str]:
    """A read-only rabbitmqctl command, tried again when it times out: on a loaded machine
    the CLI's Erlang VM alone has taken over 60 s to start (a listing is safe to repeat)."""
    for _ in range(LISTING_ATTEMPTS - 1):
        try:
            return rabbitmqctl(*args)
        except subprocess.TimeoutExpired:
            continue
    return rabbitmqctl(*args)


async def publish_all(
    amqp_url: str, queues: list[ConsumerQueue], messages: list[BadMessage], tally: AmqpTally
) -> None:
    """Each message to the next queue in turn (the default exchange, by queue name)."""
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        for start in range(0, len(messages), PUBLISH_WINDOW):
            window = list(enumerate(messages[start : start + PUBLISH_WINDOW], start))
            sends = [_publish(channel, queues[i % len(queues)], m, i, tally) for i, m in window]
            await asyncio.gather(*sends)


async def _publish(
    channel: aio_pika.abc.AbstractChannel,
    queue: ConsumerQueue,
    message: BadMessage,
    index: int,
    tally: AmqpTally,
) -> None:
    message_id = f"{tally.marker}-{index}"
    amqp_message = aio_pika.Message(
        message.body,
        message_id=message_id,
        content_type=message.content_type,
        headers=message.headers,
    )
    try:
        await channel.default_exchange.publish(amqp_message, queue.name, timeout=30)
    except aio_pika.exceptions.DeliveryError:
        tally.refused_publishes += 1
        return
    tally.sent_by_role[queue.role] += 1
    tally.labels[message.label] += 1
    tally.expected_dead.add(message_id)
    tally.target_of[message_id] = queue.role


async def collect_dead_letters(
    amqp_url: str, tally: AmqpTally, consuming: asyncio.Event, stop: asyncio.Event
) -> None:
    """Take this run's messages off the dead-letter queue (``consuming`` set once it does)
    until ``stop`` is set."""
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=500)
        queue = await channel.declare_queue(topology.DEAD_LETTER_QUEUE, passive=True)

        async def on_message(message: AbstractIncomingMessage) -> None:
            if (message.message_id or "").startswith(tally.marker):
                tally.seen_dead.add(message.message_id or "")
            await message.ack()

        tag = await queue.consume(on_message)
        consuming.set()
        await stop.wait()
        await queue.cancel(tag)


async def wait_for(condition: Any, within_s: float) -> bool:
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        if condition():
            return True
        await asyncio.sleep(0.2)
    return bool(condition())


async def run_amqp_fuzz(
    amqp_url: str,
    vhost: str,
    messages: list[BadMessage],
    settle_s: float,
    roles: tuple[str, ...] | None = None,
) -> AmqpTally:
    """Publish ``messages`` round the consumer queues (of ``roles``: all when None); wait
    for the dead letters; check that every queue kept its consumers and was drained."""
    tally = AmqpTally()
    wanted = set(roles or QUEUE_ROLES.values())
    queues = [q for q in consumer_queues(vhost) if q.role in wanted]
    for role in sorted(wanted - {q.role for q in queues}):
        tally.problems.append(f"no consumed queue of role {role}")
    consuming, stop = asyncio.Event(), asyncio.Event()
    collector = asyncio.create_task(collect_dead_letters(amqp_url, tally, consuming, stop))
    await asyncio.wait_for(consuming.wait(), 60)  # before the first dead letter
    await publish_all(amqp_url, queues, messages, tally)
    await wait_for(lambda: tally.missing_dead == 0, settle_s)
    stop.set()
    await collector
    after = await drained(vhost, queues, settle_s)
    tally.problems.extend(queue_problems(queues, after))
    return tally


async def drained(vhost: str, queues: list[ConsumerQueue], within_s: float) -> list[ConsumerQueue]:
    """The consumer queues once ours hold no messages (or as they are when time is up):
    a consumer that stopped taking messages leaves them there."""
    ours = {q.name for q in queues if q.role != "gateway-status"}  # status arrives all along
    end = time.monotonic() + within_s
    while True:
        now = consumer_queues(vhost)  # (rabbitmqctl: a second or two per call)
        if time.monotonic() > end or not any(q.depth for q in now if q.name in ours):
            return now
        await asyncio.sleep(1.0)


def queue_problems(before: list[ConsumerQueue], after: list[ConsumerQueue]) -> list[str]:
    now = {q.name: q for q in after}
    problems = []
    for queue in before:
        later = now.get(queue.name)
        if later is None or later.consumers < queue.consumers:
            problems.append(f"{queue.name} lost its consumer ({queue.role})")
        elif later.depth > 0 and queue.role != "gateway-status":
            problems.append(f"{queue.name} still holds {later.depth} messages")
    return problems

"""The RabbitMQ topology of shardserve, as data: exchanges, queues, bindings, names.

Every exchange, queue name and routing key used anywhere is built here, so the wire
layout can be read (and tested) in one place. ``declare_*`` helpers in
``shardserve.broker`` turn these values into declarations.

Exchanges (type) -> routing key -> bound queues:

- shardserve.requests (topic): <servable> -> shardserve.requests (the scheduler)
- shardserve.stage (direct): <servable>.<version>.s<stage>
  -> shardserve.agent.<servable>.<version>.r<rank>, for every rank of that stage
- shardserve.collective (direct): <servable>.<version>.s<stage>
  -> shardserve.coll.<servable>.<version>.r<rank>, for every rank of that stage
- shardserve.control (topic): agent.hello|heartbeat|bye -> shardserve.scheduler.control;
  scheduler.hello, scheduler.status, instance.<instance>, group.<servable>.<version>
  -> per-agent and per-gateway exclusive queues
- shardserve.dead (fanout) -> shardserve.dead-letters
- the default exchange: <queue name> -> scheduler result queue, gateway reply queues

A direct exchange with several queues bound under one key is a multicast: the broker
copies the bytes, so every rank of a stage receives identical input from ONE publish,
and messages from one channel reach every queue in publish order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

ExchangeKind = Literal["direct", "topic", "fanout"]

REQUESTS_EXCHANGE = "shardserve.requests"
STAGE_EXCHANGE = "shardserve.stage"
COLLECTIVE_EXCHANGE = "shardserve.collective"
CONTROL_EXCHANGE = "shardserve.control"
DEAD_EXCHANGE = "shardserve.dead"

REQUEST_QUEUE = "shardserve.requests"
SCHEDULER_CONTROL_QUEUE = "shardserve.scheduler.control"
SCHEDULER_RESULT_QUEUE = "shardserve.scheduler.results"
DEAD_LETTER_QUEUE = "shardserve.dead-letters"

KEY_AGENT_HELLO = "agent.hello"
KEY_AGENT_HEARTBEAT = "agent.heartbeat"
KEY_AGENT_BYE = "agent.bye"
KEY_SCHEDULER_HELLO = "scheduler.hello"
KEY_SCHEDULER_STATUS = "scheduler.status"

# Bounded queues: overload becomes a publisher nack (reject-publish), never a silent drop.
REQUEST_QUEUE_MAX_LENGTH = 10_000
DEAD_LETTER_MAX_LENGTH = 10_000


@dataclass(frozen=True)
class Exchange:
    name: str
    kind: ExchangeKind
    durable: bool = True


@dataclass(frozen=True)
class Queue:
    name: str
    durable: bool = False
    exclusive: bool = False
    auto_delete: bool = False
    arguments: dict[str, Any] = field(default_factory=dict)

    def __hash__(self) -> int:
        return hash(self.name)


@dataclass(frozen=True)
class Binding:
    queue: str
    exchange: str
    routing_key: str


EXCHANGES: tuple[Exchange, ...] = (
    Exchange(REQUESTS_EXCHANGE, "topic"),
    Exchange(STAGE_EXCHANGE, "direct"),
    Exchange(COLLECTIVE_EXCHANGE, "direct"),
    Exchange(CONTROL_EXCHANGE, "topic"),
    Exchange(DEAD_EXCHANGE, "fanout"),
)

_DEAD_LETTERED = {"x-dead-letter-exchange": DEAD_EXCHANGE}


def dead_letter_queue() -> Queue:
    return Queue(
        DEAD_LETTER_QUEUE,
        durable=True,
        arguments={"x-max-length": DEAD_LETTER_MAX_LENGTH, "x-queue-type": "classic"},
    )


def request_queue() -> Queue:
    """The scheduler's inbox; durable, bounded, refusing publishes when full."""
    return Queue(
        REQUEST_QUEUE,
        durable=True,
        arguments={
            **_DEAD_LETTERED,
            "x-max-length": REQUEST_QUEUE_MAX_LENGTH,
            "x-overflow": "reject-publish",
        },
    )


def scheduler_control_queue() -> Queue:
    return Queue(SCHEDULER_CONTROL_QUEUE, auto_delete=True, arguments=dict(_DEAD_LETTERED))


def scheduler_result_queue() -> Queue:
    return Queue(SCHEDULER_RESULT_QUEUE, auto_delete=True, arguments=dict(_DEAD_LETTERED))


def scheduler_bindings() -> tuple[Binding, ...]:
    return (
        Binding(REQUEST_QUEUE, REQUESTS_EXCHANGE, "#"),
        Binding(SCHEDULER_CONTROL_QUEUE, CONTROL_EXCHANGE, "agent.*"),
        Binding(DEAD_LETTER_QUEUE, DEAD_EXCHANGE, ""),
    )


def stage_key(servable: str, version: int, stage: int) -> str:
    """Routing key that reaches every rank of one stage (stage input and collectives)."""
    return f"{servable}.{version}.s{stage}"


def group_key(servable: str, version: int) -> str:
    """Control routing key that reaches every agent of one group."""
    return f"group.{servable}.{version}"


def agent_control_key(instance: str) -> str:
    """Control routing key that reaches one agent instance."""
    # Not under "agent.*": that prefix is what agents publish and the scheduler consumes.
    return f"instance.{instance}"


def agent_work_queue(servable: str, version: int, rank: int) -> Queue:
    """A rank's stage-input queue; an agent consumes it only after the scheduler accepted it."""
    return Queue(
        f"shardserve.agent.{servable}.{version}.r{rank}",
        auto_delete=True,
        arguments=dict(_DEAD_LETTERED),
    )


def agent_collective_queue(servable: str, version: int, rank: int) -> Queue:
    return Queue(f"shardserve.coll.{servable}.{version}.r{rank}", auto_delete=True)


def agent_control_queue(instance: str) -> Queue:
    return Queue(f"shardserve.agentctl.{instance}", exclusive=True, auto_delete=True)


def agent_bindings(
    servable: str, version: int, rank: int, stage: int, instance: str
) -> tuple[Binding, ...]:
    key = stage_key(servable, version, stage)
    control = agent_control_queue(instance).name
    return (
        Binding(agent_work_queue(servable, version, rank).name, STAGE_EXCHANGE, key),
        Binding(agent_collective_queue(servable, version, rank).name, COLLECTIVE_EXCHANGE, key),
        Binding(control, CONTROL_EXCHANGE, KEY_SCHEDULER_HELLO),
        Binding(control, CONTROL_EXCHANGE, agent_control_key(instance)),
        Binding(control, CONTROL_EXCHANGE, group_key(servable, version)),
    )


def reply_queue(owner: str) -> Queue:
    """A gateway's (or client's) reply queue: exclusive to its connection."""
    return Queue(f"shardserve.reply.{owner}", exclusive=True, auto_delete=True)


def status_queue(owner: str) -> Queue:
    """A gateway's queue for scheduler status broadcasts."""
    return Queue(
        f"shardserve.status.{owner}",
        exclusive=True,
        auto_delete=True,
        arguments={"x-max-length": 10, "x-message-ttl": 10_000},
    )


def status_bindings(owner: str) -> tuple[Binding, ...]:
    name = status_queue(owner).name
    return (
        Binding(name, CONTROL_EXCHANGE, KEY_SCHEDULER_STATUS),
        Binding(name, CONTROL_EXCHANGE, KEY_SCHEDULER_HELLO),
    )

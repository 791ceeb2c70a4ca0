"""The RabbitMQ topology of shardserve, as data: exchanges, queues, bindings, names.

Every exchange, queue name and routing key used anywhere is built here, so the wire
layout can be read (and tested) in one place. ``declare_*`` helpers in
``shardserve.amqp.broker`` turn these values into declarations.

Exchanges (type) -> routing key -> bound queues:

- shardserve.requests (topic): <servable> -> shardserve.requests.c1 (the active scheduler;
  single-active-consumer, bounded, per-message expiry from deadlines; a transient classic
  queue, or the quorum queue shardserve.requests.q1 on a cluster, see ``request_queue``)
- shardserve.stage (direct): <servable>.<version>.s<stage>
  -> shardserve.agent.<servable>.<version>.r<rank>, for every rank of that stage
- shardserve.collective (direct): <servable>.<version>.s<stage>
  -> shardserve.coll.<servable>.<version>.r<rank>, for every rank of that stage
- shardserve.control (topic): agent.hello|heartbeat|bye, scheduler.command
  -> shardserve.scheduler.control.<scheduler id> (one per scheduler, so a standby sees
  every hello and heartbeat too);
  scheduler.hello, scheduler.status, instance.<instance>, group.<servable>.<version>
  -> per-agent and per-gateway exclusive queues
- shardserve.dead (fanout) -> shardserve.dead-letters.q1
- the default exchange: <queue name> -> scheduler result queues
  (shardserve.scheduler.results.<scheduler id>), gateway reply queues,
  shardserve.scheduler.leader.q2 (the leadership token, see ``scheduler_leader_queue``)

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

RequestQueueType = Literal["classic", "quorum"]
REQUEST_QUEUE_TYPES: tuple[RequestQueueType, ...] = ("classic", "quorum")
# RabbitMQ refuses to redeclare an existing queue with other arguments
# (PRECONDITION_FAILED), so each type of request queue has its own name.
REQUEST_QUEUE = "shardserve.requests.c1"  # classic, the default
QUORUM_REQUEST_QUEUE = "shardserve.requests.q1"
# Prefixes: each scheduler instance has its own control and result queue (``.<id>``).
SCHEDULER_CONTROL_QUEUE = "shardserve.scheduler.control"
SCHEDULER_RESULT_QUEUE = "shardserve.scheduler.results"
# ".q2": bounded, with a delivery limit (see ``scheduler_leader_queue``); new arguments,
# so a new name (see REQUEST_QUEUE).
SCHEDULER_LEADER_QUEUE = "shardserve.scheduler.leader.q2"
DEAD_LETTER_QUEUE = "shardserve.dead-letters.q1"  # ".q1": became a quorum queue (a new name)

KEY_AGENT_HELLO = "agent.hello"
KEY_AGENT_HEARTBEAT = "agent.heartbeat"
KEY_AGENT_BYE = "agent.bye"
KEY_SCHEDULER_HELLO = "scheduler.hello"
KEY_SCHEDULER_STATUS = "scheduler.status"
KEY_SCHEDULER_COMMAND = "scheduler.command"

# Bounded queues: overload becomes a publisher nack (reject-publish), never a silent drop.
REQUEST_QUEUE_MAX_LENGTH = 10_000
DEAD_LETTER_MAX_LENGTH = 10_000
# RabbitMQ 4 gives quorum queues a default delivery limit of 20 (then drops the message);
# the leadership token is redelivered each time its holder dies or reconnects, so it gets
# a limit no mesh will reach. (3.x: no default; it takes the argument since 3.8.)
LEADER_DELIVERY_LIMIT = 1_000_000_000


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
    """Bad messages, kept for inspection (oldest dropped past the limit). Quorum: a
    durable classic queue whose node is down cannot even be redeclared (NOT_FOUND), which
    would stop every scheduler reconnect to the surviving nodes of a cluster."""
    return Queue(
        DEAD_LETTER_QUEUE,
        durable=True,
        arguments={"x-max-length": DEAD_LETTER_MAX_LENGTH, "x-queue-type": "quorum"},
    )


def request_queue_name(kind: RequestQueueType = "classic") -> str:
    return QUORUM_REQUEST_QUEUE if kind == "quorum" else REQUEST_QUEUE


def request_queue(kind: RequestQueueType = "classic") -> Queue:
    """The schedulers' inbox: bounded and refusing publishes when full; messages expire at
    their deadline (the per-message expiration set by ``Broker.publish``).
    Single-active-consumer: only the active scheduler ever receives requests, even while a
    takeover is in progress.

    ``classic`` (default): a transient queue. A request lives for its deadline and its
    reply queue dies with its gateway's connection, so keeping requests on disk buys
    nothing on one broker, and a quorum queue's log costs RabbitMQ 3x the CPU per 48 KiB
    request (``python -m benchmarks.hop_properties``: 0.075 vs 0.23 ms). ``quorum``: the
    requests survive the loss of a broker node of a cluster (replicated, RabbitMQ 3.8+);
    choose it where the broker is a cluster (deploy/k8s does). Every scheduler of a mesh
    must use the same type: both queues would be bound to the requests exchange."""
    arguments: dict[str, Any] = {
        **_DEAD_LETTERED,
        "x-single-active-consumer": True,
        "x-max-length": REQUEST_QUEUE_MAX_LENGTH,
        "x-overflow": "reject-publish",
    }
    if kind == "quorum":
        arguments["x-queue-type"] = "quorum"
    return Queue(request_queue_name(kind), durable=kind == "quorum", arguments=arguments)


def scheduler_leader_queue() -> Queue:
    """Leadership among schedulers: every scheduler consumes this single-active-consumer
    queue with prefetch 1; the one that receives the token message (and holds it unacked)
    is the active scheduler. When it dies, the broker requeues the token and delivers it
    to the next consumer, which takes over. Quorum, so it survives a broker node's loss.

    At most one token waits (max-length 1, drop-head; a held, unacked token does not
    count): a scheduler that holds none and sees none publishes one, so a token lost with
    a broker's data comes back, and the extra tokens several standbys may publish at once
    collapse into one. Only the single active consumer ever receives a token, one at a
    time (prefetch 1), so an extra waiting token never makes a second leader."""
    return Queue(
        SCHEDULER_LEADER_QUEUE,
        durable=True,
        arguments={
            "x-queue-type": "quorum",
            "x-single-active-consumer": True,
            "x-max-length": 1,
            "x-overflow": "drop-head",
            "x-delivery-limit": LEADER_DELIVERY_LIMIT,
        },
    )


def scheduler_control_queue(instance: str) -> Queue:
    """One scheduler instance's control inbox (hellos, heartbeats, byes, commands)."""
    return Queue(
        f"{SCHEDULER_CONTROL_QUEUE}.{instance}",
        exclusive=True,
        auto_delete=True,
        arguments=dict(_DEAD_LETTERED),
    )


def scheduler_result_queue(instance: str) -> Queue:
    """Where the ranks send the StageResults of the work this scheduler published."""
    return Queue(
        f"{SCHEDULER_RESULT_QUEUE}.{instance}",
        exclusive=True,
        auto_delete=True,
        arguments=dict(_DEAD_LETTERED),
    )


def request_binding(kind: RequestQueueType = "classic") -> Binding:
    """Every request, whatever its servable, to the request queue of this type."""
    return Binding(request_queue_name(kind), REQUESTS_EXCHANGE, "#")


def scheduler_bindings(
    instance: str, request_queue_type: RequestQueueType = "classic"
) -> tuple[Binding, ...]:
    control = scheduler_control_queue(instance).name
    return (
        request_binding(request_queue_type),
        Binding(control, CONTROL_EXCHANGE, "agent.*"),
        Binding(control, CONTROL_EXCHANGE, KEY_SCHEDULER_COMMAND),
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

"""A private RabbitMQ node for the broker-restart scenario, so the suite never stops the
broker other users share (``rabbitmqctl stop_app`` on it would cut every other mesh and
test off).

The node comes from ``shardserve.ops.rabbitnode`` (own node name, ports, mnesia and log
folders, Erlang cookie). Without RabbitMQ's server installed the scenario is skipped, with
the reason.
"""

from __future__ import annotations

import random
from pathlib import Path

from shardserve.ops import rabbitnode


class NoPrivateBroker(Exception):
    """A private node cannot be started here; the message says why."""


def _free_port() -> int:
    start = random.randrange(6400, 7000)
    for port in range(start, start + 300):
        if rabbitnode.port_pair_free(port):
            return port
    raise NoPrivateBroker("no free port pair for a private RabbitMQ node")


def start_node(base: Path) -> rabbitnode.RabbitNode:
    """Start a private node under ``base``; returns the RabbitNode (``url()``, ``ctl``,
    ``stop``). NoPrivateBroker when that is not possible here."""
    reason = rabbitnode.rabbit_available()
    if reason is not None:
        raise NoPrivateBroker(reason)
    node = rabbitnode.RabbitNode(base, f"sschaos-{random.randrange(10**6)}", _free_port())
    try:
        node.start()
    except rabbitnode.NodeError as exc:
        node.kill()
        raise NoPrivateBroker(str(exc)[:500]) from exc
    return node

"""A private RabbitMQ node for the broker-restart scenario, so the suite never stops the
broker other users share (``rabbitmqctl stop_app`` on it would cut every other mesh and
test off).

The node comes from ``scripts/rabbitnode.py`` of the source checkout (own node name,
ports, mnesia and log folders, Erlang cookie); it is loaded from there, since the suite
runs from a checkout (``shardserve chaos``). Without the checkout or without RabbitMQ's
server installed the scenario is skipped, with the reason.
"""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

RABBITNODE = Path(__file__).resolve().parents[4] / "scripts" / "rabbitnode.py"


class NoPrivateBroker(Exception):
    """A private node cannot be started here; the message says why."""


def _rabbitnode() -> ModuleType:
    if not RABBITNODE.exists():
        raise NoPrivateBroker(f"{RABBITNODE} not found (run from a source checkout)")
    spec = importlib.util.spec_from_file_location("shardserve_chaos_rabbitnode", RABBITNODE)
    if spec is None or spec.loader is None:
        raise NoPrivateBroker(f"cannot load {RABBITNODE}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def _free_port(rabbitnode: ModuleType) -> int:
    start = random.randrange(6400, 7000)
    for port in range(start, start + 300):
        if rabbitnode.port_pair_free(port):
            return port
    raise NoPrivateBroker("no free port pair for a private RabbitMQ node")


def start_node(base: Path) -> Any:
    """Start a private node under ``base``; returns the RabbitNode (``url()``, ``ctl``,
    ``stop``). NoPrivateBroker when that is not possible here."""
    rabbitnode = _rabbitnode()
    reason = rabbitnode.rabbit_available()
    if reason is not None:
        raise NoPrivateBroker(reason)
    node = rabbitnode.RabbitNode(base, f"sschaos-{random.randrange(10**6)}", _free_port(rabbitnode))
    try:
        node.start()
    except rabbitnode.NodeError as exc:
        node.kill()
        raise NoPrivateBroker(str(exc)[:500]) from exc
    return node

"""Scenario names, importable without the suite's heavy imports (the CLI builds its
parser from these on every ``shardserve`` run)."""

from __future__ import annotations

# Full-suite order: faults that leave the mesh running first; the broker restart late
# (it runs a private RabbitMQ node and a second mesh on it: slow to set up); the stop
# under load ends the mesh, so last.
ALL = (
    "bad-http",
    "malformed-amqp",
    "agent-stop",
    "agent-kill",
    "scheduler-kill",
    "gateway-term",
    "flood",
    "broker-restart",
    "drain",
)
# CI's fast part: no broker restart (a private node takes long to start), no flood, no stop.
QUICK = ("bad-http", "malformed-amqp", "agent-kill", "agent-stop", "scheduler-kill")

"""Scheduler settings: the command line, with defaults from ``SHARDSERVE_SCHEDULER_*``.

Read once in ``__main__``; everything else receives the frozen ``SchedulerSettings``.
"""

from __future__ import annotations

import argparse
import os
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from shardserve.process.settings import (
    BrokerSettings,
    env_default,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from shardserve.wire import topology

ENV_PREFIX = "SHARDSERVE_SCHEDULER_"

WAIT_AGENTS_HELP = (
    "if a group is still incomplete N seconds after start, log 'Failed to wait for ready of all "
    "agents of <servable> v<n>, current agents count: k, rank size: n' and report it in the "
    "status; 0 (default) waits forever. Unlike MindSpore Serving the scheduler keeps running "
    "and the group still becomes ready if its agents arrive later."
)


@dataclass(frozen=True)
class SchedulerSettings:
    """Everything the scheduler needs to know, decided once at start."""

    repository: Path
    wait_agents_seconds: int = 0
    heartbeat_timeout: float = 3.0
    max_inflight: int = 64
    status_interval: float = 1.0
    drain_seconds: float = 10.0
    max_batch_delay_ms: float = 2.0
    max_batch_size: int = 32
    python_workers: int = 4
    repository_poll_seconds: float = 2.0
    request_queue: topology.RequestQueueType = "classic"
    scheduler_id: str = field(
        default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    )
    broker: BrokerSettings = field(default_factory=BrokerSettings)


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The scheduler's command line; every option defaults from SHARDSERVE_SCHEDULER_<OPTION>."""
    env = os.environ if environ is None else environ

    def default(name: str, fallback: object = None) -> object:
        return env_default(env, ENV_PREFIX, name, fallback)

    parser = argparse.ArgumentParser(
        prog="shardserve_scheduler",
        description="Track the agents of every servable group, and run inference requests "
        "through their stages: resolve, validate, publish stage work, collect rank results, "
        "reply.",
    )
    add = parser.add_argument
    repo_default = default("REPOSITORY")
    add(
        "--repository",
        type=Path,
        default=repo_default,
        required=repo_default is None,
        help="model repository folder",
    )
    add(
        "--wait-agents-seconds",
        type=non_negative_int,
        default=default("WAIT_AGENTS_SECONDS", 0),
        help=WAIT_AGENTS_HELP,
    )
    add(
        "--heartbeat-timeout",
        type=positive_float,
        default=default("HEARTBEAT_TIMEOUT", 3.0),
        help="seconds without heartbeat after which a rank is lost (default 3)",
    )
    add(
        "--max-inflight",
        type=positive_int,
        default=default("MAX_INFLIGHT", 64),
        help="model jobs (batches) in flight per servable version, across all its pipeline "
        "stages; more wait in a FIFO of 10x this, beyond which requests are refused as "
        "overloaded (default 64: enough to keep every stage of a deep pipeline busy with "
        "several batches; 1 = one job at a time, no pipelining)",
    )
    add(
        "--status-interval",
        type=positive_float,
        default=default("STATUS_INTERVAL", 1.0),
        help="seconds between MeshStatus broadcasts (default 1)",
    )
    add(
        "--drain-seconds",
        type=non_negative_float,
        default=default("DRAIN_SECONDS", 10.0),
        help="on SIGTERM, how long in-flight requests may take to finish (default 10)",
    )
    add(
        "--max-batch-delay-ms",
        type=non_negative_float,
        default=default("MAX_BATCH_DELAY_MS", 2.0),
        help="how long a batch may wait to fill before it is sent (default 2; 0 = send "
        "what arrived with each event)",
    )
    add(
        "--max-batch-size",
        type=positive_int,
        default=default("MAX_BATCH_SIZE", 32),
        help="rows per model run for with_batch_dim servables without a fixed batch dim, "
        "instances per stacked job for servables without a batch dim "
        "(default 32; 1 disables both: one job per instance)",
    )
    add(
        "--python-workers",
        type=positive_int,
        default=default("PYTHON_WORKERS", 4),
        help="threads running Python pre/post-processing stages (default 4)",
    )
    add(
        "--repository-poll-seconds",
        type=non_negative_float,
        default=default("REPOSITORY_POLL_SECONDS", 2.0),
        help="rescan the repository this often for added/removed version folders "
        "(default 2; 0 = only on a RepositoryCommand 'load')",
    )
    add(
        "--request-queue",
        choices=topology.REQUEST_QUEUE_TYPES,
        default=default("REQUEST_QUEUE", "classic"),
        help="type of the request queue: classic (default; transient, 3x cheaper for "
        "RabbitMQ) or quorum (requests survive the loss of a node of a RabbitMQ cluster); "
        "every scheduler of a mesh must use the same",
    )
    return parser


def parse_settings(
    argv: list[str] | None = None, environ: Mapping[str, str] | None = None
) -> SchedulerSettings:
    """Parse the command line (exits with code 2 on a usage error)."""
    env = os.environ if environ is None else environ
    args = build_parser(env).parse_args(argv)
    # argparse applies ``type`` to string defaults, so env values are checked the same way.
    return SchedulerSettings(
        repository=args.repository,
        wait_agents_seconds=int(args.wait_agents_seconds),
        heartbeat_timeout=float(args.heartbeat_timeout),
        max_inflight=int(args.max_inflight),
        status_interval=float(args.status_interval),
        drain_seconds=float(args.drain_seconds),
        max_batch_delay_ms=float(args.max_batch_delay_ms),
        max_batch_size=int(args.max_batch_size),
        python_workers=int(args.python_workers),
        repository_poll_seconds=float(args.repository_poll_seconds),
        request_queue=args.request_queue,
        broker=BrokerSettings.from_env(dict(env)),
    )

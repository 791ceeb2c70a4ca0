"""Scheduler settings: the command line, with defaults from ``SHARDSERVE_SCHEDULER_*``.

Each option is declared once, on the ``SchedulerSettings`` field it fills
(``shardserve.process.options``). Read once in ``__main__``; everything else receives the
frozen ``SchedulerSettings``.
"""

from __future__ import annotations

import argparse
import os
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from shardserve.process import options
from shardserve.process.options import option
from shardserve.process.settings import (
    BrokerSettings,
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
MAX_INFLIGHT_HELP = (
    "model jobs (batches) in flight per servable version, across all its pipeline stages; "
    "more wait in a FIFO of 10x this, beyond which requests are refused as overloaded "
    "(default 64: enough to keep every stage of a deep pipeline busy with several batches; "
    "1 = one job at a time, no pipelining)"
)
MAX_BATCH_SIZE_HELP = (
    "rows per model run for with_batch_dim servables without a fixed batch dim, instances "
    "per stacked job for servables without a batch dim (default 32; 1 disables both: one job "
    "per instance)"
)
REQUEST_QUEUE_HELP = (
    "type of the request queue: classic (default; transient, 3x cheaper for RabbitMQ) or "
    "quorum (requests survive the loss of a node of a RabbitMQ cluster); every scheduler of "
    "a mesh must use the same"
)


def _scheduler_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class SchedulerSettings:
    """Everything the scheduler needs to know, decided once at start."""

    repository: Path = field(
        metadata=options.required("--repository", parse=Path, help="model repository folder")
    )
    wait_agents_seconds: int = option(
        "--wait-agents-seconds", 0, parse=non_negative_int, help=WAIT_AGENTS_HELP
    )
    heartbeat_timeout: float = option(
        "--heartbeat-timeout",
        3.0,
        parse=positive_float,
        help="seconds without heartbeat after which a rank is lost (default 3)",
    )
    max_inflight: int = option("--max-inflight", 64, parse=positive_int, help=MAX_INFLIGHT_HELP)
    leader_renew_seconds: float = option(
        "--leader-renew-seconds",
        600.0,
        parse=positive_float,
        help="how often the active scheduler renews its leadership token; keep it well "
        "under RabbitMQ's consumer_timeout (30 min by default), which closes the channel "
        "of a delivery held unacked longer (default 600)",
    )
    status_interval: float = option(
        "--status-interval",
        1.0,
        parse=positive_float,
        help="seconds between MeshStatus broadcasts (default 1)",
    )
    drain_seconds: float = option(
        "--drain-seconds",
        10.0,
        parse=non_negative_float,
        help="on SIGTERM, how long in-flight requests may take to finish (default 10)",
    )
    max_batch_delay_ms: float = option(
        "--max-batch-delay-ms",
        2.0,
        parse=non_negative_float,
        help="how long a batch may wait to fill before it is sent (default 2; 0 = send what "
        "arrived with each event)",
    )
    max_batch_size: int = option(
        "--max-batch-size", 32, parse=positive_int, help=MAX_BATCH_SIZE_HELP
    )
    python_workers: int = option(
        "--python-workers",
        4,
        parse=positive_int,
        help="threads running Python pre/post-processing stages (default 4)",
    )
    repository_poll_seconds: float = option(
        "--repository-poll-seconds",
        2.0,
        parse=non_negative_float,
        help="rescan the repository this often for added/removed version folders (default 2; "
        "0 = only on a RepositoryCommand 'load')",
    )
    request_queue: topology.RequestQueueType = option(
        "--request-queue",
        "classic",
        choices=topology.REQUEST_QUEUE_TYPES,
        help=REQUEST_QUEUE_HELP,
    )
    max_running_sequences: int = option(
        "--max-running-sequences",
        64,
        parse=positive_int,
        help="generation: sequences per servable version holding KV cache at once (default 64)",
    )
    max_waiting_sequences: int = option(
        "--max-waiting-sequences",
        256,
        parse=non_negative_int,
        help="generation: sequences per servable version waiting for KV cache room; beyond, "
        "503 with Retry-After (default 256)",
    )
    max_prefill_tokens: int = option(
        "--max-prefill-tokens",
        512,
        parse=positive_int,
        help="generation: prompt tokens per step; longer prompts go in chunks (default 512)",
    )
    step_timeout_seconds: float = option(
        "--step-timeout-seconds",
        30.0,
        parse=positive_float,
        help="generation: a step not through every stage after this long fails its sequences "
        "(default 30)",
    )
    max_decode_steps: int = option(
        "--max-decode-steps",
        8,
        parse=positive_int,
        help="generation: decode steps one StepWork may carry for a group of one stage, its "
        "ranks feeding each step's tokens to the next without a round trip through the "
        "scheduler (default 8; 1 = one step per StepWork)",
    )
    decode_run_ms: float = option(
        "--decode-run-ms",
        200.0,
        parse=positive_float,
        help="generation: such a run of decode steps lasts about this long at most (from "
        "recent step times): a new request waits at most about this long for a run to end "
        "before its prefill joins (default 200)",
    )
    scheduler_id: str = field(default_factory=_scheduler_id)
    broker: BrokerSettings = field(default_factory=BrokerSettings)


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The scheduler's command line; every option defaults from SHARDSERVE_SCHEDULER_<OPTION>."""
    return options.build_parser(
        SchedulerSettings,
        os.environ if environ is None else environ,
        prefix=ENV_PREFIX,
        prog="shardserve_scheduler",
        description="Track the agents of every servable group, and run inference requests "
        "through their stages: resolve, validate, publish stage work, collect rank results, "
        "reply.",
    )


def parse_settings(
    argv: list[str] | None = None, environ: Mapping[str, str] | None = None
) -> SchedulerSettings:
    """Parse the command line (exits with code 2 on a usage error)."""
    env = os.environ if environ is None else environ
    args = build_parser(env).parse_args(argv)
    return SchedulerSettings(
        **options.option_values(SchedulerSettings, args), broker=BrokerSettings.from_env(env)
    )

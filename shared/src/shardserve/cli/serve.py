"""``shardserve up`` (run a whole mesh here, supervised) and ``shardserve status`` (its
rank x stage grid); the work is done by ``shardserve.ops.launch``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from shardserve.cli.common import positive_int
from shardserve.ops.launch.service_options import add_service_options
from shardserve.process.settings import threads_count

if TYPE_CHECKING:
    from shardserve.cli.common import Subparsers

DEFAULT_STATUS_URL = "http://127.0.0.1:8080"


def _run_up(args: argparse.Namespace) -> int:
    from shardserve.ops.launch.plan import UpOptions
    from shardserve.ops.launch.service_options import service_argvs
    from shardserve.ops.launch.up import run_up

    options = UpOptions(
        repository=args.repository,
        host=args.host,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        wait_agents_seconds=args.wait_agents_seconds,
        threads=args.threads,
        no_cache=args.no_cache,
        grace_seconds=args.grace_seconds,
        schedulers=args.schedulers,
        gateways=args.gateways,
        repository_poll_seconds=args.repository_poll_seconds,
        max_memory_mb=args.max_memory_mb,
        kv_cache_mb=args.kv_cache_mb,
        service_args=service_argvs(args),
    )
    return run_up(options)


def build_up(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "up", help="run scheduler, gateway and one agent per rank of a repository, supervised"
    )
    parser.add_argument(
        "repository",
        type=Path,
        nargs="?",
        default=None,
        metavar="REPO",
        help="model repository (default: the matmul demo, exported on first use)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="gateway bind address")
    parser.add_argument("--http-port", type=int, default=8080)
    parser.add_argument(
        "--grpc-port",
        type=int,
        default=None,
        help="the gateway's KServe v2 / Triton gRPC port (0: none; default: the gateway's, "
        "8001 or SHARDSERVE_GATEWAY_GRPC_PORT)",
    )
    parser.add_argument("--wait-agents-seconds", type=float, default=0.0)
    parser.add_argument(
        "--threads",
        type=threads_count,
        default=None,
        help="onnxruntime threads per agent; default auto: an even share of the cores this "
        "process may use (affinity, cgroup quota) among the agents it starts, at least 1; "
        "a count above that share is lowered to it (extra threads only preempt each other)",
    )
    parser.add_argument("--no-cache", action="store_true", help="agents skip the session cache")
    parser.add_argument(
        "--max-memory-mb",
        type=positive_int,
        default=None,
        help="every agent's memory cap in MiB (RLIMIT_DATA; the agent's --max-memory-mb)",
    )
    parser.add_argument(
        "--kv-cache-mb",
        type=positive_int,
        default=None,
        help="generation servables: every agent's KV cache budget in MiB (the agent's "
        "--kv-cache-mb; default from free memory and the cap)",
    )
    parser.add_argument(
        "--schedulers",
        type=positive_int,
        default=1,
        help="scheduler processes: one active, the others standby, taking over when it dies",
    )
    parser.add_argument(
        "--gateways",
        type=positive_int,
        default=1,
        help="gateway processes sharing the HTTP port (SO_REUSEPORT): JSON decoding of "
        "large bodies then uses more than one core (default 1)",
    )
    parser.add_argument(
        "--repository-poll-seconds",
        type=_non_negative_float,
        default=2.0,
        help="look for added/removed version folders this often: a new one gets its "
        "agents, a removed one loses them (default 2; 0 = read the repository once)",
    )
    parser.add_argument(
        "--grace-seconds",
        type=float,
        default=15.0,
        help="per tier on stop: wait this long after SIGTERM, then SIGKILL",
    )
    add_service_options(parser)
    parser.set_defaults(handler=_run_up)


def _non_negative_float(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value:g}")
    return value


def _run_status(args: argparse.Namespace) -> int:
    from shardserve.ops.launch.records import live_records
    from shardserve.ops.launch.status import StatusUnavailable, fetch_status, format_status

    records = live_records()
    url = args.url or (records[0].url if records else DEFAULT_STATUS_URL)
    try:
        status = fetch_status(url, timeout=args.timeout)
    except StatusUnavailable as exc:
        print(f"shardserve status: {exc}", file=sys.stderr)
        return 1
    print(format_status(status))
    return 0


def build_status(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser("status", help="show every servable's rank x stage grid")
    parser.add_argument(
        "--url",
        default=None,
        help="gateway base URL (default: the gateway of the newest `shardserve up` running "
        f"on this machine, else {DEFAULT_STATUS_URL})",
    )
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.set_defaults(handler=_run_status)

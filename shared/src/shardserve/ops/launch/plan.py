"""What ``shardserve up`` runs: the repository's servable versions and the command line
of every process (scheduler, gateway, one agent per rank of each version)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path

from shardserve.errors import RepositoryError
from shardserve.process.cores import threads_per_agent, usable_cores
from shardserve.process.supervise import EXIT_REFUSED, EXIT_USAGE, ChildSpec
from shardserve.repo.repository import (
    GroupConfig,
    list_servables,
    list_versions,
    load_group,
    verify_rank_files,
)
from shardserve.runtime.compile_cache import cache_root

# Passed to the scheduler explicitly: a dead agent's rank is free again after it.
HEARTBEAT_TIMEOUT_S = 3.0
DEMO_SERVABLE = "matmul"
DEMO_RANKS = 8

GroupKey = tuple[str, int]  # (servable, version)


@dataclass(frozen=True)
class UpOptions:
    repository: Path | None = None
    host: str = "127.0.0.1"
    http_port: int = 8080
    grpc_port: int | None = None  # None: the gateway's default (8001, or its env variable)
    wait_agents_seconds: float = 0.0
    threads: int | None = None  # onnxruntime threads per agent; None: see with_agent_threads
    no_cache: bool = False
    grace_seconds: float = 15.0
    status_interval: float = 0.5
    schedulers: int = 1  # >1: one active, the others standby (see shardserve_scheduler.service)
    gateways: int = 1  # >1: every one serves, sharing the HTTP port (SO_REUSEPORT)
    repository_poll_seconds: float = 2.0  # 0: versions are read once, at start
    # Passed to every agent; None: the agent's own default (see shardserve_agent.settings).
    max_memory_mb: int | None = None
    kv_cache_mb: int | None = None
    # (service, arguments): the services' own options given to up (see service_options).
    service_args: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def args_of(self, service: str) -> tuple[str, ...]:
        return dict(self.service_args).get(service, ())


def with_agent_threads(options: UpOptions, agents: int) -> tuple[UpOptions, int]:
    """``options`` with a thread count for every agent: an even share of the usable cores,
    or the count asked for when it is smaller (``shardserve.process.cores``); and the usable
    cores."""
    cores = usable_cores()
    return replace(options, threads=threads_per_agent(agents, cores, options.threads)), cores


def group_key(group: GroupConfig) -> GroupKey:
    return (group.servable, group.version)


# ---------------------------------------------------------------- repository


def repository_version_is_valid(repo: Path, servable: str, version: int) -> bool:
    """True when a version's group config loads and every rank's files match their sha256."""
    return version_problem(repo, servable, version) is None


def version_problem(repo: Path, servable: str, version: int) -> str | None:
    """Why a version cannot be served (its group.json or a rank's files), or None."""
    try:
        group = load_group(repo, servable, version)
        for rank in range(group.rank_size):
            verify_rank_files(repo, group, rank)
    except (RepositoryError, OSError) as exc:
        return str(exc)
    return None


def ensure_demo_repository(root: Path | None = None) -> Path:
    """The matmul demo (8 ranks, column split), exported once and re-exported if damaged."""
    root = root or cache_root() / "demo"
    if repository_version_is_valid(root, DEMO_SERVABLE, 1):
        return root
    from shardserve.tools.export.matmul import export_matmul

    print(f"exporting the demo model ({DEMO_SERVABLE}, {DEMO_RANKS} ranks) to {root}", flush=True)
    root.mkdir(parents=True, exist_ok=True)
    # The exporter builds the version folder aside and renames it into place, so an
    # interrupted export never looks valid; overwrite replaces a damaged one.
    export_matmul(
        root,
        rank_size=DEMO_RANKS,
        stage_size=1,
        strategy="column",
        overwrite=True,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
    )
    return root


def discover_groups(repo: Path) -> list[GroupConfig]:
    """Every servable version of a repository; refuses an empty one."""
    groups = [
        load_group(repo, servable, version)
        for servable in list_servables(repo)
        for version in list_versions(repo, servable)
    ]
    if not groups:
        raise RepositoryError(f"model repository {repo} holds no servable version")
    return groups


# ---------------------------------------------------------------- command lines


def service_argv(service: str, *args: str) -> tuple[str, ...]:
    return (sys.executable, "-m", f"shardserve_{service}", *args)


def agent_specs(
    repo: Path, group: GroupConfig, options: UpOptions, show_version: bool
) -> list[ChildSpec]:
    """One supervised agent per rank of ``group``. A refused registration (exit 3, e.g.
    the scheduler unloaded the version) is final; a crash is restarted with the plain
    back-off: a successor refused while its predecessor still holds the rank asks again."""
    suffix = f" v{group.version}" if show_version else ""
    return [
        ChildSpec(
            label=f"agent {group.servable} r{rank}{suffix}",
            argv=service_argv(
                "agent",
                "--repository",
                str(repo),
                "--servable",
                group.servable,
                "--version",
                str(group.version),
                "--rank",
                str(rank),
                "--threads",
                str(options.threads or 1),
                *(["--no-cache"] if options.no_cache else []),
                *_agent_memory_args(options),
                *options.args_of("agent"),
            ),
            final_codes=frozenset({EXIT_USAGE, EXIT_REFUSED}),
        )
        for rank in range(group.rank_size)
    ]


def _agent_memory_args(options: UpOptions) -> list[str]:
    args = []
    if options.max_memory_mb is not None:
        args += ["--max-memory-mb", str(options.max_memory_mb)]
    if options.kv_cache_mb is not None:
        args += ["--kv-cache-mb", str(options.kv_cache_mb)]
    return args


def agent_plan(
    repo: Path, groups: list[GroupConfig], options: UpOptions
) -> list[tuple[GroupConfig, list[ChildSpec]]]:
    """The agents of each version found at start (labels name the version only when
    their servable has several)."""
    return [(g, agent_specs(repo, g, options, _several_versions(groups, g))) for g in groups]


def plan_children(
    repo: Path, groups: list[GroupConfig], options: UpOptions
) -> dict[str, list[ChildSpec]]:
    """The processes of a mesh, per tier (scheduler, agents, gateway)."""
    agents = [spec for _, specs in agent_plan(repo, groups, options) for spec in specs]
    schedulers = [
        ChildSpec(
            "scheduler" if options.schedulers == 1 else f"scheduler {index}",
            _scheduler_argv(repo, options),
        )
        for index in range(options.schedulers)
    ]
    return {"scheduler": schedulers, "agent": agents, "gateway": _gateway_specs(options)}


def _gateway_specs(options: UpOptions) -> list[ChildSpec]:
    """One gateway, or several sharing the port: each an independent gateway (its own id,
    reply queue, in-flight limit and metrics); the kernel spreads connections over them."""
    shared = ("--reuse-port",) if options.gateways > 1 else ()
    grpc = () if options.grpc_port is None else ("--grpc-port", str(options.grpc_port))
    argv = service_argv(
        "gateway",
        "--host",
        options.host,
        "--http-port",
        str(options.http_port),
        *grpc,
        *shared,
        *options.args_of("gateway"),
    )
    return [
        ChildSpec("gateway" if options.gateways == 1 else f"gateway {index}", argv)
        for index in range(options.gateways)
    ]


def _scheduler_argv(repo: Path, options: UpOptions) -> tuple[str, ...]:
    return service_argv(
        "scheduler",
        "--repository",
        str(repo),
        "--wait-agents-seconds",
        f"{options.wait_agents_seconds:g}",
        "--heartbeat-timeout",
        f"{HEARTBEAT_TIMEOUT_S:g}",
        "--repository-poll-seconds",
        f"{options.repository_poll_seconds:g}",
        *options.args_of("scheduler"),  # after the defaults above: a given one wins
    )


def _several_versions(groups: list[GroupConfig], group: GroupConfig) -> bool:
    """Whether labels need a version (the servable has several)."""
    return sum(1 for g in groups if g.servable == group.servable) > 1


# The gateway starts before the agents so that their loading can be watched through it
# (it answers 503 until the groups are ready); stop order is explained in shardserve.ops.launch.up.
START_ORDER = ("scheduler", "gateway", "agent")
STOP_ORDER = ("gateway", "scheduler", "agent")

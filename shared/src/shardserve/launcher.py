"""``shardserve up``: one command that runs a whole mesh on this machine, supervised.

It checks the broker, exports the demo repository on first use (when no repository is
given), then starts the scheduler, the gateway and one agent per rank of every servable
version, each as ``python -m shardserve_<svc> ...`` in its own process group (see
``shardserve.supervise``), restarting any that dies. While agents load, it polls the
gateway's ``/api/status`` and prints readiness as it changes.

Stop order (Ctrl-C / SIGTERM) follows the request flow, upstream first, so that nothing
in flight is lost: the **gateway** first (it stops taking HTTP requests and waits for the
replies of those it accepted, which needs the scheduler and agents still running), then
the **scheduler** (it takes no new requests and finishes its in-flight jobs, which needs
the agents), then the **agents** (their queues are empty by then; they say bye and leave).
Each tier gets SIGTERM, ``grace_seconds`` to exit, then SIGKILL. A second Ctrl-C kills
everything at once.

A crashed agent is restarted no sooner than the scheduler's heartbeat timeout (plus a
margin): until the scheduler has marked the dead instance's rank lost, it refuses a new
instance for that rank as "already served", and a refused agent exits 3, which is final.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from shardserve.errors import RepositoryError
from shardserve.repository import (
    GroupConfig,
    list_servables,
    list_versions,
    load_group,
    verify_rank_files,
)
from shardserve.settings import AMQP_URL_ENV, BrokerSettings
from shardserve.supervise import EXIT_REFUSED, EXIT_USAGE, ChildSpec, Supervised

# Passed to the scheduler explicitly, because agent restarts wait for it (see above).
HEARTBEAT_TIMEOUT_S = 3.0
AGENT_RESTART_FLOOR_S = HEARTBEAT_TIMEOUT_S + 1.5
DEMO_SERVABLE = "matmul"
DEMO_RANKS = 8
EXIT_FAILED = 1


class LaunchError(Exception):
    """``up`` cannot start; the message says why and what to do."""


class StatusUnavailable(Exception):
    """The gateway's status endpoint cannot be read."""


@dataclass(frozen=True)
class UpOptions:
    repository: Path | None = None
    host: str = "127.0.0.1"
    http_port: int = 8080
    wait_agents_seconds: float = 0.0
    threads: int = 1
    no_cache: bool = False
    grace_seconds: float = 15.0
    status_interval: float = 0.5
    schedulers: int = 1  # >1: one active, the others standby (see shardserve_scheduler.service)


# ---------------------------------------------------------------- repository


def repository_version_is_valid(repo: Path, servable: str, version: int) -> bool:
    """True when a version's group config loads and every rank's files match their sha256."""
    try:
        group = load_group(repo, servable, version)
        for rank in range(group.rank_size):
            verify_rank_files(repo, group, rank)
    except (RepositoryError, OSError):
        return False
    return True


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "shardserve"


def ensure_demo_repository(root: Path | None = None) -> Path:
    """The matmul demo (8 ranks, column split), exported once and re-exported if damaged."""
    root = root or default_cache_dir() / "demo"
    if repository_version_is_valid(root, DEMO_SERVABLE, 1):
        return root
    from shardserve.export.matmul import export_matmul

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


# ---------------------------------------------------------------- plan


def _service_argv(service: str, *args: str) -> tuple[str, ...]:
    return (sys.executable, "-m", f"shardserve_{service}", *args)


def plan_children(
    repo: Path, groups: list[GroupConfig], options: UpOptions
) -> dict[str, list[ChildSpec]]:
    """The processes of a mesh, per tier (scheduler, agents, gateway)."""
    agents = [
        ChildSpec(
            label=f"agent {g.servable} r{rank}"
            + (f" v{g.version}" if _versions(groups, g) else ""),
            argv=_service_argv(
                "agent",
                "--repository",
                str(repo),
                "--servable",
                g.servable,
                "--version",
                str(g.version),
                "--rank",
                str(rank),
                "--threads",
                str(options.threads),
                *(["--no-cache"] if options.no_cache else []),
            ),
            final_codes=frozenset({EXIT_USAGE, EXIT_REFUSED}),
            min_restart_delay=AGENT_RESTART_FLOOR_S,
        )
        for g in groups
        for rank in range(g.rank_size)
    ]
    schedulers = [
        ChildSpec(
            "scheduler" if options.schedulers == 1 else f"scheduler {index}",
            _scheduler_argv(repo, options),
        )
        for index in range(options.schedulers)
    ]
    gateway = ChildSpec(
        "gateway",
        _service_argv(
            "gateway",
            "--host",
            options.host,
            "--http-port",
            str(options.http_port),
        ),
    )
    return {"scheduler": schedulers, "agent": agents, "gateway": [gateway]}


def _scheduler_argv(repo: Path, options: UpOptions) -> tuple[str, ...]:
    return _service_argv(
        "scheduler",
        "--repository",
        str(repo),
        "--wait-agents-seconds",
        f"{options.wait_agents_seconds:g}",
        "--heartbeat-timeout",
        f"{HEARTBEAT_TIMEOUT_S:g}",
    )


def _versions(groups: list[GroupConfig], group: GroupConfig) -> bool:
    """Whether labels need a version (the servable has several)."""
    return sum(1 for g in groups if g.servable == group.servable) > 1


# The gateway starts before the agents so that their loading can be watched through it
# (it answers 503 until the groups are ready); stop order is explained at the top.
START_ORDER = ("scheduler", "gateway", "agent")
STOP_ORDER = ("gateway", "scheduler", "agent")


# ---------------------------------------------------------------- broker


def redact(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


async def check_broker(settings: BrokerSettings, connect_timeout: float = 5.0) -> None:
    """Open (and close) one AMQP connection, so a wrong host or password shows up now."""
    import aio_pika

    failures = []
    for url in settings.urls:
        try:
            connection = await aio_pika.connect(url, timeout=connect_timeout)
        except Exception as exc:  # any failure means "not usable"; we report all of them
            failures.append(f"{redact(url)}: {exc or type(exc).__name__}")
            continue
        await connection.close()
        return
    raise LaunchError(
        "cannot reach RabbitMQ (" + "; ".join(failures) + "). Start one (scripts/ensure-rabbitmq)"
        f" or point {AMQP_URL_ENV} at a running broker."
    )


# ---------------------------------------------------------------- status


def fetch_status(base_url: str, timeout: float = 5.0) -> dict[str, Any]:
    """``GET <gateway>/api/status`` as JSON."""
    url = base_url.rstrip("/") + "/api/status"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            data = json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise StatusUnavailable(f"cannot read {url}: {getattr(exc, 'reason', exc)}") from exc
    if not isinstance(data, dict):
        raise StatusUnavailable(f"{url} did not answer a JSON object")
    return data


def _ready_count(servable: dict[str, Any]) -> int:
    return sum(1 for r in servable.get("ranks", ()) if r.get("state") == "ready")


def progress_lines(status: dict[str, Any], groups: list[GroupConfig]) -> dict[str, str]:
    """One line per expected servable version, e.g. ``matmul v1: 5/8 ranks ready``."""
    seen = {(s.get("name"), s.get("version")): s for s in status.get("servables", ())}
    lines: dict[str, str] = {}
    for g in groups:
        key = f"{g.servable} v{g.version}"
        entry = seen.get((g.servable, g.version))
        if entry is None:
            lines[key] = f"{key}: not known to the scheduler yet"
            continue
        line = f"{key}: {_ready_count(entry)}/{g.rank_size} ranks ready"
        if entry.get("ready"):
            line += " (group ready)"
        elif entry.get("reason") and _ready_count(entry) == g.rank_size:
            line += f" ({entry['reason']})"
        lines[key] = line
    return lines


def all_ready(status: dict[str, Any], groups: list[GroupConfig]) -> bool:
    ready = {
        (s.get("name"), s.get("version")) for s in status.get("servables", ()) if s.get("ready")
    }
    return bool(status.get("fresh", True)) and all((g.servable, g.version) in ready for g in groups)


def _age(value: Any) -> str:
    return "-" if value is None else f"{float(value):.1f}s"


def format_status(status: dict[str, Any]) -> str:
    """The rank x stage grid of every servable, as ``shardserve status`` prints it."""
    lines = []
    if not status.get("fresh", True):
        lines.append("warning: the scheduler's status is stale (no broadcast for > 3 s)")
    servables = status.get("servables", ())
    if not servables:
        lines.append("no servables known to the scheduler")
    for s in servables:
        state = "ready" if s.get("ready") else f"NOT READY: {s.get('reason') or '-'}"
        lines.append(
            f"{s.get('name')} v{s.get('version')}  {state}  ranks {s.get('rank_size')} x "
            f"stages {s.get('stage_size')}  in-flight {s.get('inflight', 0)}"
        )
        lines.append(
            f"  {'stage':>5} {'rank':>4}  {'state':<8} {'beat':>6}  {'checksum':<12} "
            f"{'cache':<5} {'rss MB':>7} {'in-flight':>9}  host/pid"
        )
        for r in sorted(s.get("ranks", ()), key=lambda r: (r.get("stage", 0), r.get("rank", 0))):
            rss = f"{r.get('rss_bytes', 0) / 2**20:.1f}"
            where = f"{r.get('host') or '-'}/{r.get('pid') or '-'}"
            lines.append(
                f"  {r.get('stage', 0):>5} {r.get('rank', 0):>4}  {r.get('state', '?'):<8} "
                f"{_age(r.get('heartbeat_age_s')):>6}  {(r.get('slice_checksum') or '-')[:12]:<12} "
                f"{r.get('cache', '-'):<5} {rss:>7} {r.get('inflight', 0):>9}  {where}"
            )
    return "\n".join(lines)


def public_url(host: str, port: int) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    return f"http://{shown}:{port}"


async def watch_progress(base_url: str, groups: list[GroupConfig], interval: float) -> None:
    """Print readiness lines when they change, and the infer URLs once all groups are ready."""
    shown: dict[str, str] = {}
    announced = False
    while True:
        try:
            status = await asyncio.to_thread(fetch_status, base_url, 2.0)
        except StatusUnavailable:
            status = None
        if status is not None:
            for key, line in progress_lines(status, groups).items():
                if shown.get(key) != line:
                    print(line, flush=True)
                    shown[key] = line
            ready = all_ready(status, groups)
            if ready and not announced:
                targets = sorted({g.servable for g in groups})
                urls = ", ".join(f"POST {base_url}/v2/models/{name}/infer" for name in targets)
                print(f"all groups ready: {urls}", flush=True)
            elif announced and not ready:
                print("not every group is ready any more (see above)", flush=True)
            announced = ready
        await asyncio.sleep(interval)


# ---------------------------------------------------------------- run


class Mesh:
    """The supervised processes of one ``up``, started and stopped by tier."""

    def __init__(self, tiers: dict[str, list[ChildSpec]], env: dict[str, str]) -> None:
        self.tiers = {
            name: [Supervised(spec, env=env) for spec in specs] for name, specs in tiers.items()
        }
        self.stop_requested = asyncio.Event()
        self.failed = False

    @property
    def children(self) -> list[Supervised]:
        return [child for tier in self.tiers.values() for child in tier]

    def on_signal(self) -> None:
        if self.stop_requested.is_set():
            print("second signal: killing every process now", file=sys.stderr, flush=True)
            self.kill_all()
        self.stop_requested.set()

    def kill_all(self) -> None:
        for child in self.children:
            child.kill_now()

    async def watch_core(self, child: Supervised) -> None:
        """Scheduler and gateway: if one gives up (usage error), the whole mesh stops."""
        await child.run()
        if child.gave_up:
            print(f"{child.spec.label} cannot run; stopping", file=sys.stderr, flush=True)
            self.failed = True
            self.stop_requested.set()

    async def stop(self, grace: float) -> None:
        print("stopping: gateway, then scheduler, then agents", file=sys.stderr, flush=True)
        for name in STOP_ORDER:
            tier = self.tiers.get(name, [])
            await asyncio.gather(*(child.stop(grace) for child in tier))
        print("stopped", file=sys.stderr, flush=True)


async def serve(repo: Path, groups: list[GroupConfig], options: UpOptions) -> int:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    mesh = Mesh(plan_children(repo, groups, options), env)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, mesh.on_signal)
    base_url = public_url(options.host, options.http_port)
    try:
        async with asyncio.TaskGroup() as tasks:
            for name in START_ORDER:
                for child in mesh.tiers[name]:
                    tasks.create_task(child.run() if name == "agent" else mesh.watch_core(child))
            watcher = tasks.create_task(watch_progress(base_url, groups, options.status_interval))
            await mesh.stop_requested.wait()
            watcher.cancel()
            await mesh.stop(options.grace_seconds)
    finally:
        mesh.kill_all()  # no-op after a clean stop; never leave children behind on a bug
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return EXIT_FAILED if mesh.failed else 0


def run_up(options: UpOptions) -> int:
    """Entry point of ``shardserve up``; returns the exit code."""
    from shardserve.errors import ExportError

    try:
        repo = options.repository or ensure_demo_repository()
        groups = discover_groups(repo)
    except (RepositoryError, ExportError) as exc:
        print(f"shardserve up: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        asyncio.run(check_broker(BrokerSettings.from_env()))
    except LaunchError as exc:
        print(f"shardserve up: {exc}", file=sys.stderr)
        return EXIT_FAILED
    total = sum(g.rank_size for g in groups)
    print(
        f"serving {repo}: {len(groups)} servable version(s), {total} agent(s); "
        f"gateway on {public_url(options.host, options.http_port)}",
        flush=True,
    )
    return asyncio.run(serve(repo.resolve(), groups, options))

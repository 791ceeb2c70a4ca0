"""Reading the mesh's state through the gateway (``GET /api/status``) and printing it:
``shardserve up``'s readiness lines and ``shardserve status``'s rank x stage grid."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from shardserve.ops.launch.plan import GroupKey
from shardserve.repo.repository import GroupConfig
from shardserve.servable import GENERATION_TASK

Status = dict[str, Any]


class StatusUnavailable(Exception):
    """The gateway's status endpoint cannot be read."""


def fetch_status(base_url: str, timeout: float = 5.0) -> Status:
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


def listed_versions(status: Status) -> dict[GroupKey, dict[str, Any]]:
    """(servable, version) -> its entry, for every version the scheduler knows."""
    return {(s.get("name"), s.get("version")): s for s in status.get("servables", ())}


def _ready_count(servable: dict[str, Any]) -> int:
    return sum(1 for r in servable.get("ranks", ()) if r.get("state") == "ready")


def progress_lines(status: Status, groups: list[GroupConfig]) -> dict[str, str]:
    """One line per expected servable version, e.g. ``matmul v1: 5/8 ranks ready``."""
    seen = listed_versions(status)
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


def all_ready(status: Status, groups: list[GroupConfig]) -> bool:
    ready = {key for key, s in listed_versions(status).items() if s.get("ready")}
    return bool(status.get("fresh", True)) and all((g.servable, g.version) in ready for g in groups)


def _age(value: Any) -> str:
    return "-" if value is None else f"{float(value):.1f}s"


def format_status(status: Status) -> str:
    """The rank x stage grid of every servable, as ``shardserve status`` prints it."""
    lines = []
    if not status.get("fresh", True):
        lines.append("warning: the scheduler's status is stale (no broadcast for > 3 s)")
    servables = status.get("servables", ())
    if not servables:
        lines.append("no servables known to the scheduler")
    for s in servables:
        lines.extend(_servable_lines(s))
    return "\n".join(lines)


def _servable_lines(s: dict[str, Any]) -> list[str]:
    state = "ready" if s.get("ready") else f"NOT READY: {s.get('reason') or '-'}"
    lines = [
        f"{s.get('name')} v{s.get('version')}  {state}  ranks {s.get('rank_size')} x "
        f"stages {s.get('stage_size')}  in-flight {s.get('inflight', 0)}{_sequences(s)}",
        f"  {'stage':>5} {'rank':>4}  {'state':<8} {'beat':>6}  {'checksum':<12} "
        f"{'cache':<5} {'rss MB':>7} {'in-flight':>9}  host/pid",
    ]
    for r in sorted(s.get("ranks", ()), key=lambda r: (r.get("stage", 0), r.get("rank", 0))):
        rss = f"{r.get('rss_bytes', 0) / 2**20:.1f}"
        where = f"{r.get('host') or '-'}/{r.get('pid') or '-'}"
        lines.append(
            f"  {r.get('stage', 0):>5} {r.get('rank', 0):>4}  {r.get('state', '?'):<8} "
            f"{_age(r.get('heartbeat_age_s')):>6}  {(r.get('slice_checksum') or '-')[:12]:<12} "
            f"{r.get('cache', '-'):<5} {rss:>7} {r.get('inflight', 0):>9}  {where}"
            + (_kv_use(r) if s.get("generation") else "")
        )
    return lines


def _sequences(s: dict[str, Any]) -> str:
    """For a generation servable: its running and waiting sequences."""
    if not s.get("generation"):
        return ""
    running, waiting = s.get("running_sequences", 0), s.get("waiting_sequences", 0)
    return f"  sequences {running} running, {waiting} waiting"


def _kv_use(r: dict[str, Any]) -> str:
    """A generation rank's KV cache use, e.g. ``  kv 12.5/256.0 MB (3 seq)``."""
    used, capacity = r.get("kv_used_bytes", 0) / 2**20, r.get("kv_capacity_bytes", 0) / 2**20
    return f"  kv {used:.1f}/{capacity:.1f} MB ({r.get('sequences', 0)} seq)"


def public_url(host: str, port: int) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    return f"http://{shown}:{port}"


class StatusBoard:
    """The latest fresh status read by ``watch_progress`` (None when there is none), for
    whoever else needs to know what the scheduler serves (the repository watcher)."""

    def __init__(self) -> None:
        self.latest: Status | None = None


async def watch_progress(
    base_url: str,
    groups: Callable[[], list[GroupConfig]],
    interval: float,
    board: StatusBoard | None = None,
) -> None:
    """Print readiness lines when they change, and the infer URLs once all ``groups()``
    (the versions the launcher runs agents for right now) are ready."""
    shown: dict[str, str] = {}
    announced = False
    while True:
        try:
            status: Status | None = await asyncio.to_thread(fetch_status, base_url, 2.0)
        except StatusUnavailable:
            status = None
        if board is not None:
            board.latest = status if status is not None and status.get("fresh", True) else None
        if status is not None:
            expected = groups()
            _print_changed(progress_lines(status, expected), shown)
            ready = bool(expected) and all_ready(status, expected)
            if ready and not announced:
                urls = ", ".join(_entry_point(base_url, g) for g in _one_per_servable(expected))
                print(f"all groups ready: {urls}", flush=True)
            elif announced and not ready:
                print("not every group is ready any more (see above)", flush=True)
            announced = ready
        await asyncio.sleep(interval)


def _one_per_servable(groups: list[GroupConfig]) -> list[GroupConfig]:
    return list({g.servable: g for g in sorted(groups, key=lambda g: g.servable)}.values())


def _entry_point(base_url: str, group: GroupConfig) -> str:
    """Where to send requests: completions for a text-generation servable, else infer."""
    if group.origin.get("task") == GENERATION_TASK:
        return f"POST {base_url}/v1/completions (model {group.servable!r})"
    return f"POST {base_url}/v2/models/{group.servable}/infer"


def _print_changed(lines: dict[str, str], shown: dict[str, str]) -> None:
    for key, line in lines.items():
        if shown.get(key) != line:
            print(line, flush=True)
            shown[key] = line

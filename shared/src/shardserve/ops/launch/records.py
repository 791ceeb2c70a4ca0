"""What a running ``shardserve up`` leaves on this machine for the other commands: one JSON
record per ``up`` (its pid, gateway URL, repository and broker vhost) under
``<cache_root>/up/<pid>.json``, written once the mesh starts and removed when it stops.

``shardserve status`` reads them to find the gateway ``up`` started (whatever port it took);
``up`` reads them to name the running mesh when it refuses to start a second one on a vhost.
A record whose process is gone (killed) is ignored and removed.

Usage::

    with UpRecord(pid, url, repository, vhost).kept():
        ...                                    # the mesh runs
    live_records()                             # newest first
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from shardserve.runtime.compile_cache import cache_root

__all__ = ["UpRecord", "live_records", "records_folder", "vhost_of"]


def records_folder(environ: Mapping[str, str] | None = None) -> Path:
    return cache_root(environ) / "up"


def vhost_of(amqp_url: str) -> str:
    """The vhost an AMQP URL names ("/" when it names none, as RabbitMQ defaults)."""
    path = urlsplit(amqp_url).path
    return unquote(path[1:]) if len(path) > 1 else "/"


@dataclass(frozen=True)
class UpRecord:
    pid: int
    url: str
    repository: str
    vhost: str

    def describe(self) -> str:
        return f"`shardserve up {self.repository}` (pid {self.pid}, gateway {self.url})"

    @contextlib.contextmanager
    def kept(self, folder: Path | None = None) -> Iterator[None]:
        """The record exists while the block runs."""
        folder = folder or records_folder()
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{self.pid}.json"
        path.write_text(json.dumps(asdict(self)), encoding="utf-8")
        try:
            yield
        finally:
            path.unlink(missing_ok=True)


def live_records(folder: Path | None = None) -> list[UpRecord]:
    """The records of ``up`` processes still running, newest first."""
    folder = folder or records_folder()
    found: list[tuple[float, UpRecord]] = []
    for path in folder.glob("*.json") if folder.is_dir() else ():
        record = _read(path)
        if record is None or not _alive(record.pid):
            path.unlink(missing_ok=True)  # its `up` was killed before it could remove it
            continue
        found.append((path.stat().st_mtime, record))
    return [record for _, record in sorted(found, key=lambda item: -item[0])]


def _read(path: Path) -> UpRecord | None:
    try:
        return UpRecord(**json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    return True

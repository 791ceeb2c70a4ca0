"""A mesh on this machine: ``shardserve up REPO --http-port P`` as a child process.

One runner for everything that starts whole meshes locally (the integration tests, the
chaos suite, the benchmarks): a fresh RabbitMQ vhost where the broker is local and
``rabbitmqctl`` is there (so meshes never share a request queue), a process group of its
own with a log file, readiness by ``/v2/health/ready``, the service processes found among
the launcher's children (``/proc``), and a stop that sends SIGTERM, waits, then SIGKILLs
the group so nothing outlives the caller.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

from shardserve.process.integers import parse_positive_int
from shardserve.process.settings import AMQP_URL_ENV, DEFAULT_AMQP_URL

SHARDSERVE = str(Path(sys.executable).parent / "shardserve")
READY_PATH = "/v2/health/ready"


class MeshError(RuntimeError):
    """A mesh or process did not start, get ready or stop, or a process was not found."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def base_amqp_url() -> str:
    return os.environ.get(AMQP_URL_ENV, DEFAULT_AMQP_URL)


# --- vhosts ---------------------------------------------------------------------------


def with_vhost(url: str, vhost: str) -> str:
    return urlunsplit(urlsplit(url)._replace(path="/" + quote(vhost, safe="")))


def rabbitmqctl(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["rabbitmqctl", "-q", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def can_make_vhosts(url: str) -> bool:
    """Vhosts can be made for ``url``: the broker is on this machine and rabbitmqctl is here."""
    host = urlsplit(url).hostname
    return shutil.which("rabbitmqctl") is not None and host in ("127.0.0.1", "localhost")


def _ctl(*args: str, attempts: int) -> None:
    for attempt in range(1, attempts + 1):
        done = rabbitmqctl(*args)
        if done.returncode == 0:
            return
        if attempt == attempts:
            raise MeshError(f"rabbitmqctl {' '.join(args)} failed: {done.stderr.strip()}")
        time.sleep(1.0)  # a busy node sometimes refuses a fresh vhost once


def create_vhost(url: str, prefix: str, *, attempts: int = 1) -> str:
    """A new vhost named ``<prefix>-<random>`` that ``url``'s user may use fully."""
    vhost = f"{prefix}-{uuid.uuid4().hex[:10]}"
    _ctl("add_vhost", vhost, attempts=attempts)
    user = urlsplit(url).username or "guest"
    try:
        _ctl("set_permissions", "-p", vhost, user, ".*", ".*", ".*", attempts=attempts)
    except MeshError:
        delete_vhost(vhost)
        raise
    return vhost


def delete_vhost(vhost: str) -> None:
    rabbitmqctl("delete_vhost", vhost)


@contextlib.contextmanager
def isolated_vhost(url: str, prefix: str, *, attempts: int = 1) -> Iterator[str]:
    """The URL of a fresh vhost (deleted afterwards); ``url`` itself if none can be made."""
    if not can_make_vhosts(url):
        yield url
        return
    vhost = create_vhost(url, prefix, attempts=attempts)
    try:
        yield with_vhost(url, vhost)
    finally:
        delete_vhost(vhost)


# --- processes ------------------------------------------------------------------------


def http_get(url: str, timeout: float = 10.0) -> tuple[int, Any]:
    """(status, JSON body or None); status 0 when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read() or b"null")
        except ValueError:
            return exc.code, None
    except (OSError, ValueError):
        return 0, None


def children_of(parent: int) -> list[int]:
    """Pids whose parent is ``parent`` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        pid = parse_positive_int(entry.name)
        if pid is None:
            continue
        with contextlib.suppress(OSError, IndexError):
            stat = (entry / "stat").read_text()
            if parse_positive_int(stat.rsplit(")", 1)[1].split()[1]) == parent:
                found.append(pid)
    return found


def cmdline(pid: int) -> list[str]:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []


def rss_bytes(pid: int) -> int:
    """Resident set size of one process right now (VmRSS), 0 when it is gone."""
    try:
        for line in (Path("/proc") / str(pid) / "status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def tail_of(log_path: Path, lines: int) -> str:
    """The last ``lines`` lines of a log file ("" when there is none yet)."""
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class LoggedProcess:
    """One child in a process group of its own, its output in ``log_path``."""

    argv: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.argv,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise MeshError(f"{self.argv[:3]} was never started")
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM, wait; SIGKILL the group if it is stuck. The exit code, None if killed
        (or never started)."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
            return None

    def log_tail(self, lines: int = 80) -> str:
        return tail_of(self.log_path, lines)

    def wait_http_ready(self, url: str, timeout: float, interval: float = 0.25) -> float:
        """Poll ``url`` until it answers 200; return the seconds it took."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if not self.alive():
                raise MeshError(f"{self.argv[:3]} exited early:\n{self.log_tail()}")
            if http_get(url, timeout=5.0)[0] == 200:
                return time.monotonic() - started
            time.sleep(interval)
        raise MeshError(f"{url} not ready after {timeout:.0f} s:\n{self.log_tail()}")


@dataclass
class LocalMesh:
    """One ``shardserve up REPO --http-port P --grpc-port G UP_ARGS`` against ``amqp_url``
    (``grpc_port`` 0, the default: no gRPC, so that meshes started side by side on one
    machine never race for the gateway's default gRPC port)."""

    repo: Path
    amqp_url: str
    http_port: int
    log_path: Path
    up_args: tuple[str, ...] = ()
    extra_env: Mapping[str, str] = field(default_factory=dict)
    grpc_port: int = 0
    process: LoggedProcess = field(init=False, repr=False)

    def __post_init__(self) -> None:
        argv = [SHARDSERVE, "up", str(self.repo), "--http-port", str(self.http_port)]
        argv += ["--grpc-port", str(self.grpc_port)]
        self.process = LoggedProcess([*argv, *self.up_args], self.env, self.log_path)

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        return self.process.proc

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def env(self) -> dict[str, str]:
        """The launcher's environment; service options default from it (children inherit)."""
        return {**os.environ, AMQP_URL_ENV: self.amqp_url, "PYTHONUNBUFFERED": "1"} | dict(
            self.extra_env
        )

    @property
    def running(self) -> bool:
        return self.process.alive()

    def start(self) -> None:
        self.process.start()

    def wait_ready(self, timeout: float = 180.0) -> float:
        """Block until the gateway says ready; the seconds it took."""
        return self.process.wait_http_ready(self.http_url + READY_PATH, timeout)

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM the launcher (it stops every tier in order); SIGKILL its group if stuck."""
        return self.process.stop(timeout)

    def log_tail(self, lines: int = 80) -> str:
        return self.process.log_tail(lines)

    def get(self, path: str, timeout: float = 10.0) -> tuple[int, Any]:
        return http_get(self.http_url + path, timeout)

    def status(self) -> dict[str, Any]:
        code, body = self.get("/api/status")
        if code != 200 or not isinstance(body, dict):
            raise MeshError(f"/api/status answered {code}: {body}")
        return body

    def ranks(self, servable: str) -> list[dict[str, Any]]:
        """The status entries of ``servable``'s ranks (empty when it is unknown)."""
        for entry in self.status().get("servables", ()):
            if entry.get("name") == servable:
                return list(entry.get("ranks", ()))
        return []

    def rank_pid(self, servable: str, rank: int) -> int:
        """The pid of the agent serving ``rank``, as the status reports it."""
        for entry in self.ranks(servable):
            if entry["rank"] == rank:
                return int(entry["pid"])
        raise MeshError(f"no pid for {servable} rank {rank}")

    def service_pids(self, service: str) -> list[int]:
        """Pids of ``python -m shardserve_<service>`` children of the launcher."""
        if self.proc is None:
            return []
        module = f"shardserve_{service}"
        return [pid for pid in children_of(self.proc.pid) if module in cmdline(pid)]

    def service_pid(self, service: str) -> int:
        pids = self.service_pids(service)
        if not pids:
            raise MeshError(f"no {service} process is running")
        return pids[0]

    def agent_pid(self, rank: int) -> int:
        """The agent process of ``rank``, by its command line."""
        for pid in self.service_pids("agent"):
            args = cmdline(pid)
            if "--rank" in args and args[args.index("--rank") + 1] == str(rank):
                return pid
        raise MeshError(f"no agent process for rank {rank}")

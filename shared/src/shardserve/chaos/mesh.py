"""A mesh for the chaos suite: ``shardserve up`` on a vhost of its own, on 127.0.0.1.

The suite exports a small matmul repository, creates a fresh RabbitMQ vhost (when the
broker is local and ``rabbitmqctl`` is there), starts ``shardserve up`` as a subprocess
and finds the service processes among its children (``/proc``), so faults can be aimed
at one scheduler, gateway or agent rank by pid.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from shardserve.settings import AMQP_URL_ENV, DEFAULT_AMQP_URL

SHARDSERVE = str(Path(sys.executable).parent / "shardserve")


class MeshError(Exception):
    """The mesh could not be started or a process could not be found."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rabbitmqctl(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["rabbitmqctl", "-q", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def broker_is_local(url: str) -> bool:
    host = urlsplit(url).hostname
    return shutil.which("rabbitmqctl") is not None and host in ("127.0.0.1", "localhost")


def with_vhost(url: str, vhost: str) -> str:
    return urlunsplit(urlsplit(url)._replace(path="/" + quote(vhost, safe="")))


def children_of(parent: int) -> list[int]:
    """Pids whose parent is ``parent`` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == parent:
                found.append(int(entry.name))
    return found


def cmdline(pid: int) -> list[str]:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []


def rss_bytes(pid: int) -> int:
    """Resident set size of one process (0 when it is gone)."""
    try:
        for line in (Path("/proc") / str(pid) / "status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


@dataclass
class ChaosMesh:
    """One ``shardserve up`` for the suite; ``start`` then ``stop`` (also a context manager)."""

    workdir: Path
    ranks: int = 2
    base_amqp_url: str = field(
        default_factory=lambda: os.environ.get(AMQP_URL_ENV, DEFAULT_AMQP_URL)
    )
    http_port: int = field(default_factory=free_port)
    vhost: str | None = None
    proc: subprocess.Popen[bytes] | None = None
    own_vhost: bool = True  # False: the broker is private to this mesh (no vhost needed)

    @property
    def amqp_url(self) -> str:
        return with_vhost(self.base_amqp_url, self.vhost) if self.vhost else self.base_amqp_url

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "mesh.log"

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, AMQP_URL_ENV: self.amqp_url, "PYTHONUNBUFFERED": "1"}

    def export(self) -> Path:
        repo = self.workdir / "repo"
        args = ["export", "matmul", "--rank-size", str(self.ranks), "--out", str(repo)]
        done = subprocess.run(
            [SHARDSERVE, *args, "--if-missing"], capture_output=True, text=True, timeout=300
        )
        if done.returncode != 0:
            raise MeshError(f"export failed: {done.stderr.strip()}")
        return repo

    def _make_vhost(self) -> None:
        if not self.own_vhost or not broker_is_local(self.base_amqp_url):
            return
        vhost = f"shardserve-chaos-{uuid.uuid4().hex[:10]}"
        user = urlsplit(self.base_amqp_url).username or "guest"
        if rabbitmqctl("add_vhost", vhost).returncode != 0:
            return  # not permitted: run on the given vhost
        rabbitmqctl("set_permissions", "-p", vhost, user, ".*", ".*", ".*")
        self.vhost = vhost

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        repo = self.export()
        self._make_vhost()
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [
                SHARDSERVE,
                "up",
                str(repo),
                "--http-port",
                str(self.http_port),
                "--grace-seconds",
                "15",
            ],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def service_pids(self, service: str) -> list[int]:
        """Pids of ``python -m shardserve_<service>`` children of this mesh's launcher."""
        if self.proc is None:
            return []
        return [
            pid for pid in children_of(self.proc.pid) if f"shardserve_{service}" in cmdline(pid)
        ]

    def service_pid(self, service: str) -> int:
        pids = self.service_pids(service)
        if not pids:
            raise MeshError(f"no {service} process is running")
        return pids[0]

    def agent_pid(self, rank: int) -> int:
        for pid in self.service_pids("agent"):
            args = cmdline(pid)
            if "--rank" in args and args[args.index("--rank") + 1] == str(rank):
                return pid
        raise MeshError(f"no agent process for rank {rank}")

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM the launcher (it stops every tier in order); SIGKILL its group if stuck."""
        code = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        elif self.proc is not None:
            code = self.proc.returncode
        return code

    def cleanup(self) -> None:
        if self.vhost is not None:
            rabbitmqctl("delete_vhost", self.vhost)
            self.vhost = None

    def log_tail(self, lines: int = 60) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_gone(self, pid: int, within_s: float = 10.0) -> bool:
        end = time.monotonic() + within_s
        while time.monotonic() < end:
            if not Path(f"/proc/{pid}").exists() or "zombie" in _state(pid):
                return True
            time.sleep(0.05)
        return False


def _state(pid: int) -> str:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("State:"):
                return line
    except OSError:
        return "gone"
    return ""

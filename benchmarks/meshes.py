"""Processes the benchmarks run against: meshes (``shardserve up``), the floor server and
the broker responder, on one dedicated RabbitMQ vhost that is deleted at the end.

Every process gets its own session (process group) and a log file; ``stop`` sends SIGTERM,
waits, then SIGKILLs the group, so nothing outlives the run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

from shardserve.settings import AMQP_URL_ENV, DEFAULT_AMQP_URL

SHARDSERVE = str(Path(sys.executable).parent / "shardserve")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def base_amqp_url() -> str:
    return os.environ.get(AMQP_URL_ENV, DEFAULT_AMQP_URL)


def with_vhost(url: str, vhost: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + quote(vhost, safe="")))


def _rabbitmqctl(*args: str, attempts: int = 3) -> None:
    """Run rabbitmqctl; retried, because a busy node sometimes refuses a fresh vhost once."""
    for attempt in range(1, attempts + 1):
        done = subprocess.run(["rabbitmqctl", "-q", *args], capture_output=True, timeout=60)
        if done.returncode == 0:
            return
        if attempt == attempts:
            error = done.stderr.decode(errors="replace").strip()
            raise RuntimeError(f"rabbitmqctl {' '.join(args)} failed: {error}")
        time.sleep(1.0)


@contextmanager
def dedicated_vhost(url: str | None = None) -> Iterator[str]:
    """A fresh vhost for the run (deleted afterwards); the plain URL if none can be made."""
    url = url or base_amqp_url()
    host = urlsplit(url).hostname
    if shutil.which("rabbitmqctl") is None or host not in ("127.0.0.1", "localhost"):
        yield url
        return
    vhost = f"shardserve-bench-{uuid.uuid4().hex[:10]}"
    _rabbitmqctl("add_vhost", vhost)
    user = urlsplit(url).username or "guest"
    try:
        _rabbitmqctl("set_permissions", "-p", vhost, user, ".*", ".*", ".*")
        yield with_vhost(url, vhost)
    finally:
        _rabbitmqctl("delete_vhost", vhost)


def http_get(url: str, timeout: float = 5.0) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, None
    except (urllib.error.URLError, OSError, ValueError):
        return 0, None


@dataclass
class Process:
    """One child process group with its log."""

    argv: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def start(self) -> None:
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            self.argv,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 60.0) -> None:
        if not self.alive():
            return
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_http_ready(self, url: str, timeout: float) -> float:
        """Poll ``url`` until it answers 200; return the seconds it took."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if not self.alive():
                raise RuntimeError(f"{self.argv[:3]} exited early:\n{self.log_tail()}")
            if http_get(url, timeout=2.0)[0] == 200:
                return time.monotonic() - started
            time.sleep(0.2)
        raise RuntimeError(f"{url} not ready after {timeout:.0f} s:\n{self.log_tail()}")


@dataclass
class Mesh:
    """A running ``shardserve up REPO`` on the benchmark vhost."""

    process: Process
    http_port: int
    ready_s: float = 0.0

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def infer_url(self, model: str) -> str:
        return f"{self.http_url}/v2/models/{model}/infer"

    def status(self) -> dict[str, Any]:
        code, body = http_get(self.http_url + "/api/status")
        if code != 200 or not isinstance(body, dict):
            raise RuntimeError(f"/api/status answered {code}")
        return body

    def ranks(self, servable: str) -> list[dict[str, Any]]:
        for entry in self.status().get("servables", ()):
            if entry.get("name") == servable:
                return list(entry.get("ranks", ()))
        return []


@contextmanager
def running_mesh(
    repo: Path,
    amqp_url: str,
    logs: Path,
    *,
    env: dict[str, str] | None = None,
    up_args: tuple[str, ...] = (),
    ready_timeout: float = 300.0,
) -> Iterator[Mesh]:
    """``shardserve up REPO --http-port P`` until the gateway is ready; stopped on exit.

    ``env`` adds service options (``SHARDSERVE_SCHEDULER_MAX_BATCH_SIZE=...``): every
    service option defaults from its environment variable, and children inherit it."""
    port = free_port()
    full_env = {**os.environ, AMQP_URL_ENV: amqp_url, "PYTHONUNBUFFERED": "1", **(env or {})}
    argv = [SHARDSERVE, "up", str(repo), "--http-port", str(port), *up_args]
    log = logs / f"mesh-{repo.name}-{port}.log"
    process = Process(argv, full_env, log)
    mesh = Mesh(process, port)
    process.start()
    try:
        mesh.ready_s = process.wait_http_ready(mesh.http_url + "/v2/health/ready", ready_timeout)
        yield mesh
    finally:
        process.stop()


@contextmanager
def running_module(
    module: str, args: list[str], logs: Path, ready_url: str | None, env: dict[str, str]
) -> Iterator[Process]:
    """``python -m MODULE ARGS`` until ``ready_url`` answers (or it prints ``ready``)."""
    log = logs / f"{module.rsplit('.', 1)[-1]}-{uuid.uuid4().hex[:6]}.log"
    process = Process([sys.executable, "-m", module, *args], {**os.environ, **env}, log)
    process.start()
    try:
        if ready_url is not None:
            process.wait_http_ready(ready_url, 60.0)
        else:
            _wait_log_line(process, "ready", 60.0)
        yield process
    finally:
        process.stop()


def _wait_log_line(process: Process, line: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if line in process.log_tail(20).splitlines():
            return
        if not process.alive():
            raise RuntimeError(f"{process.argv[:3]} exited early:\n{process.log_tail()}")
        time.sleep(0.1)
    raise RuntimeError(f"{process.argv[:3]} did not print {line!r}:\n{process.log_tail()}")


def rss_bytes(pid: int) -> int:
    """Resident set size of a process right now (VmRSS), 0 if unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process (all its threads) has used so far, 0 if gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    # After the command name: state is field 3, utime 14 and stime 15 (1-based, man proc).
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def service_pids(up_pid: int) -> dict[str, int]:
    """The gateway/scheduler/agent children of a ``shardserve up`` process, by module."""
    out = subprocess.run(
        ["ps", "--ppid", str(up_pid), "-o", "pid=,args="], capture_output=True, text=True
    ).stdout
    pids: dict[str, int] = {}
    for line in out.splitlines():
        pid, _, args = line.strip().partition(" ")
        match = re.search(r"-m shardserve_(\w+)(?:.*--rank (\d+))?", args)
        if match:
            name = match.group(1) + (f".r{match.group(2)}" if match.group(2) else "")
            pids[name] = int(pid)
    return pids


def broker_pid(port: int = 5672) -> int | None:
    """The process listening on the AMQP port (RabbitMQ's beam.smp), if visible."""
    out = subprocess.run(
        ["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True
    ).stdout
    match = re.search(r"pid=(\d+)", out)
    return int(match.group(1)) if match else None


class CpuMeter:
    """CPU milliseconds used by a set of processes between ``start`` and ``per_request``."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self._before = {name: cpu_seconds(pid) for name, pid in pids.items()}

    def per_request(self, requests: int) -> dict[str, float]:
        if requests <= 0:
            return {}
        return {
            name: round((cpu_seconds(pid) - self._before[name]) * 1000.0 / requests, 3)
            for name, pid in self.pids.items()
        }

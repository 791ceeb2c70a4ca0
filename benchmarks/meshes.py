"""Processes the benchmarks run against: meshes (``shardserve up``), the floor server and
the broker responder, on one dedicated RabbitMQ vhost that is deleted at the end.

Every process gets its own session (process group) and a log file; ``stop`` sends SIGTERM,
waits, then SIGKILLs the group, so nothing outlives the run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from shardserve.ops.child_mesh import (
    LocalMesh,
    LoggedProcess,
    base_amqp_url,
    children_of,
    cmdline,
    free_port,
    isolated_vhost,
)


@contextmanager
def dedicated_vhost(url: str | None = None) -> Iterator[str]:
    """A fresh vhost for the run (deleted afterwards); the plain URL if none can be made.

    rabbitmqctl is retried: a busy node sometimes refuses a fresh vhost once."""
    with isolated_vhost(url or base_amqp_url(), "shardserve-bench", attempts=3) as vhost_url:
        yield vhost_url


Process = LoggedProcess  # one child process group with its log


@dataclass
class Mesh(LocalMesh):
    """A running ``shardserve up REPO`` on the benchmark vhost."""

    ready_s: float = 0.0

    def infer_url(self, model: str) -> str:
        return f"{self.http_url}/v2/models/{model}/infer"


@contextmanager
def running_mesh(
    repo: Path,
    amqp_url: str,
    logs: Path,
    *,
    env: dict[str, str] | None = None,
    gateways: int = 1,
    ready_timeout: float = 300.0,
    up_args: tuple[str, ...] = (),
    grpc: bool = False,
) -> Iterator[Mesh]:
    """``shardserve up REPO --http-port P --gateways N`` until the gateway is ready (all
    ``gateways`` of them listening, so that a load's connections spread over them);
    stopped on exit.

    ``env`` adds service options (``SHARDSERVE_SCHEDULER_MAX_BATCH_SIZE=...``): every
    service option defaults from its environment variable, and children inherit it.
    ``up_args`` adds ``shardserve up`` options (``--threads 1``); ``grpc`` gives the
    gateway a gRPC port (``mesh.grpc_port``)."""
    port = free_port()
    log = logs / f"mesh-{repo.name}-{port}.log"
    up = ("--gateways", str(gateways), *up_args)
    mesh = Mesh(repo, amqp_url, port, log, up, env or {}, free_port() if grpc else 0)
    mesh.start()
    try:
        mesh.ready_s = mesh.wait_ready(ready_timeout)
        _wait_listening(mesh, gateways, ready_timeout)
        yield mesh
    finally:
        mesh.stop()


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


def _wait_listening(mesh: Mesh, gateways: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while mesh.log_path.read_text(errors="replace").count(" listening on ") < gateways:
        if time.monotonic() > deadline:
            raise RuntimeError(f"fewer than {gateways} gateways listen after {timeout:g} s")
        time.sleep(0.1)


def _wait_log_line(process: Process, line: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if line in process.log_tail(20).splitlines():
            return
        if not process.alive():
            raise RuntimeError(f"{process.argv[:3]} exited early:\n{process.log_tail()}")
        time.sleep(0.1)
    raise RuntimeError(f"{process.argv[:3]} did not print {line!r}:\n{process.log_tail()}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process (all its threads) has used so far, 0 if gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    # After the command name: state is field 3, utime 14 and stime 15 (1-based, man proc).
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def service_pids(up_pid: int) -> dict[str, int]:
    """The gateway/scheduler/agent children of a ``shardserve up`` process, by module
    (``gateway``, ``scheduler``, ``agent.r0``...)."""
    pids: dict[str, int] = {}
    for pid in children_of(up_pid):
        args = cmdline(pid)
        module = args[args.index("-m") + 1] if "-m" in args[:-1] else ""
        if module.startswith("shardserve_"):
            rank = args[args.index("--rank") + 1] if "--rank" in args[:-1] else None
            name = module.removeprefix("shardserve_") + (f".r{rank}" if rank else "")
            pids[numbered_name(name, pids)] = pid
    return pids


def numbered_name(name: str, taken: dict[str, int]) -> str:
    """``name``, or ``name.1``, ``name.2``... when several processes share it (gateways)."""
    index = 0
    key = name
    while key in taken:
        index += 1
        key = f"{name}.{index}"
    return key


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

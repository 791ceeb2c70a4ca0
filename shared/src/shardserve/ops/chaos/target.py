"""A mesh for the chaos suite: ``shardserve up`` on a vhost of its own, on 127.0.0.1.

The suite exports a small matmul repository, creates a fresh RabbitMQ vhost (when the
broker is local and ``rabbitmqctl`` is there), starts ``shardserve up`` as a subprocess
and finds the service processes among its children (``/proc``), so faults can be aimed
at one scheduler, gateway or agent rank by pid.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from shardserve.ops.child_mesh import (
    SHARDSERVE,
    LocalMesh,
    MeshError,
    base_amqp_url,
    can_make_vhosts,
    create_vhost,
    delete_vhost,
    free_port,
    rss_bytes,
    tail_of,
    with_vhost,
)

__all__ = ["ChaosMesh", "MeshError", "rss_bytes"]


@dataclass
class ChaosMesh:
    """One ``shardserve up`` for the suite; ``start`` then ``stop`` and ``cleanup``."""

    workdir: Path
    ranks: int = 2
    base_amqp_url: str = field(default_factory=base_amqp_url)
    http_port: int = field(default_factory=free_port)
    grpc_port: int = 0  # 0: the gateway serves no gRPC
    vhost: str | None = None
    own_vhost: bool = True  # False: the broker is private to this mesh (no vhost needed)
    # HF checkpoints served beside the matmul (name -> checkpoint folder), at TP 2
    hf_checkpoints: dict[str, Path] = field(default_factory=dict)
    mesh: LocalMesh | None = field(default=None, repr=False)

    @property
    def amqp_url(self) -> str:
        return with_vhost(self.base_amqp_url, self.vhost) if self.vhost else self.base_amqp_url

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "mesh.log"

    def export(self) -> Path:
        repo = self.workdir / "repo"
        _export(["matmul", "--rank-size", str(self.ranks), "--out", str(repo)])
        for name, checkpoint in self.hf_checkpoints.items():
            _export(["hf", str(checkpoint), "--rank-size", "2", "--name", name, "--out", str(repo)])
        return repo

    def _make_vhost(self) -> None:
        if not self.own_vhost or not can_make_vhosts(self.base_amqp_url):
            return
        with contextlib.suppress(MeshError):  # not permitted: run on the given vhost
            self.vhost = create_vhost(self.base_amqp_url, "shardserve-chaos")

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        repo = self.export()
        self._make_vhost()
        up_args = ("--grace-seconds", "15")
        self.mesh = LocalMesh(
            repo, self.amqp_url, self.http_port, self.log_path, up_args, grpc_port=self.grpc_port
        )
        self.mesh.start()

    def _running_mesh(self) -> LocalMesh:
        if self.mesh is None:
            raise MeshError("the mesh was never started")
        return self.mesh

    @property
    def running(self) -> bool:
        return self.mesh is not None and self.mesh.running

    def service_pid(self, service: str) -> int:
        return self._running_mesh().service_pid(service)

    def agent_pid(self, rank: int) -> int:
        return self._running_mesh().agent_pid(rank)

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM the launcher (it stops every tier in order); SIGKILL its group if stuck."""
        return None if self.mesh is None else self.mesh.stop(timeout)

    def cleanup(self) -> None:
        if self.vhost is not None:
            delete_vhost(self.vhost)
            self.vhost = None

    def log_tail(self, lines: int = 60) -> str:
        return tail_of(self.log_path, lines)

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


def _export(args: list[str]) -> None:
    done = subprocess.run(
        [SHARDSERVE, "export", *args, "--if-missing"], capture_output=True, text=True, timeout=300
    )
    if done.returncode != 0:
        raise MeshError(f"export failed: {done.stderr.strip()}")

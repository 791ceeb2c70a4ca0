"""Real meshes for integration tests: `shardserve up` as a subprocess on its own vhost.

A mesh is exactly what a user starts: the launcher spawns the scheduler, the gateway and
one agent process per rank; tests talk to it over HTTP and RabbitMQ only.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


SHARDSERVE = str(Path(sys.executable).parent / "shardserve")


@dataclass
class Mesh:
    """One running `shardserve up`."""

    repo: Path
    amqp_url: str
    http_port: int
    log_path: Path
    extra_args: tuple[str, ...] = ()
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SHARDSERVE_AMQP_URL": self.amqp_url, "PYTHONUNBUFFERED": "1"}

    def start(self) -> None:
        args = [
            SHARDSERVE,
            "up",
            str(self.repo),
            "--http-port",
            str(self.http_port),
            *self.extra_args,
        ]
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            args,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"shardserve up exited early:\n{self.log_tail()}")
            if self.get("/v2/health/ready")[0] == 200:
                return
            time.sleep(0.25)
        raise AssertionError(f"mesh not ready after {timeout}s:\n{self.log_tail()}")

    def get(self, path: str) -> tuple[int, Any]:
        try:
            with urllib.request.urlopen(self.http_url + path, timeout=10) as resp:
                return resp.status, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"null")
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return 0, None

    def status(self) -> dict[str, Any]:
        code, body = self.get("/api/status")
        assert code == 200, body
        return body  # type: ignore[no-any-return]

    def rank_pid(self, servable: str, rank: int) -> int:
        for s in self.status()["servables"]:
            if s["name"] == servable:
                for r in s["ranks"]:
                    if r["rank"] == rank:
                        return int(r["pid"])
        raise AssertionError(f"no pid for {servable} rank {rank}")

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired as exc:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
            raise AssertionError(
                f"shardserve up did not stop in {timeout}s:\n{self.log_tail()}"
            ) from exc

    def log_tail(self, lines: int = 80) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def export(kind: str, out: Path, *args: str) -> Path:
    """Run `shardserve export KIND ...` as a user would; return the repository."""
    done = subprocess.run(
        [SHARDSERVE, "export", kind, *args, "--out", str(out)],
        capture_output=True,
        timeout=300,
        text=True,
    )
    assert done.returncode == 0, f"export failed: {done.stderr}"
    return out


@pytest.fixture(scope="session")
def export_repo() -> Any:
    """`export_repo(kind, out, *args)` runs `shardserve export` and returns the repository."""
    return export


@pytest.fixture(scope="module")
def mesh_factory(isolated_amqp_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Start meshes on this module's vhost; all are stopped at module teardown."""
    meshes: list[Mesh] = []

    def start(repo: Path, *extra: str, wait: bool = True) -> Mesh:
        log = tmp_path_factory.mktemp("mesh") / "mesh.log"
        mesh = Mesh(repo, isolated_amqp_url, free_port(), log, tuple(extra))
        meshes.append(mesh)
        mesh.start()
        if wait:
            mesh.wait_ready()
        return mesh

    yield start
    for mesh in reversed(meshes):
        mesh.stop()


@pytest.fixture(scope="module")
def mesh_matmul8(mesh_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> Mesh:
    """The demo: matmul over 8 ranks, column strategy."""
    repo = export(
        "matmul",
        tmp_path_factory.mktemp("repo"),
        "--rank-size",
        "8",
        "--stage-size",
        "1",
        "--strategy",
        "column",
    )
    return mesh_factory(repo)  # type: ignore[no-any-return]

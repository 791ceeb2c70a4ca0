"""Real meshes for integration tests: `shardserve up` as a subprocess on its own vhost.

A mesh is exactly what a user starts: the launcher spawns the scheduler, the gateway and
one agent process per rank; tests talk to it over HTTP and RabbitMQ only.
"""

from __future__ import annotations

import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shardserve.ops.child_mesh import SHARDSERVE, LocalMesh, free_port

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test of this folder ``integration`` (a ``pytestmark`` in a conftest is
    ignored by pytest: it applies to test modules only)."""
    for item in items:
        if item.path.is_relative_to(HERE):
            item.add_marker(pytest.mark.integration)


class Mesh(LocalMesh):
    """One running `shardserve up`; a stop that needs SIGKILL fails the test."""

    def stop(self, timeout: float = 60.0) -> int:
        started = self.proc is not None
        code = super().stop(timeout)
        if code is None and started:
            raise AssertionError(f"shardserve up did not stop in {timeout}s:\n{self.log_tail()}")
        return code or 0

    def metric(self, name: str) -> float:
        """The sum over labels of one metric in the gateway's ``/metrics``."""
        with urllib.request.urlopen(self.http_url + "/metrics", timeout=10) as resp:
            lines = resp.read().decode().splitlines()
        picked = (line for line in lines if line.startswith((name + " ", name + "{")))
        return sum(float(line.rsplit(" ", 1)[1]) for line in picked)


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

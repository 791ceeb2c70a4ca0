"""The launcher's repository watcher, driven poll by poll against a real repository on
disk and a recording stand-in for the mesh (no processes): which versions get agents,
when, and which lose them."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, cast

import pytest

from shardserve.ops.launch.plan import GroupKey, UpOptions
from shardserve.ops.launch.processes import Mesh
from shardserve.ops.launch.status import StatusBoard
from shardserve.ops.launch.watch import RepositoryWatcher, versions_on_disk
from shardserve.process.supervise import ChildSpec
from shardserve.repo.repository import GroupConfig, load_group
from shardserve.tools.export.matmul import export_matmul


class RecordingMesh:
    """What the watcher calls on a Mesh, recorded."""

    def __init__(self) -> None:
        self.groups: dict[GroupKey, tuple[GroupConfig, list[ChildSpec]]] = {}
        self.started: list[tuple[GroupKey, list[ChildSpec]]] = []
        self.retired: list[GroupKey] = []
        self.refused: set[GroupKey] = set()  # versions whose agents all exited 3

    def start_group(self, group: GroupConfig, specs: list[ChildSpec]) -> None:
        key = (group.servable, group.version)
        self.groups[key] = (group, specs)
        self.started.append((key, specs))

    def retire(self, key: GroupKey, patience: float, grace: float) -> None:
        del self.groups[key]
        self.retired.append(key)

    def released(self, key: GroupKey) -> bool:
        return key in self.refused

    def forget(self, key: GroupKey) -> None:
        self.groups.pop(key, None)


def _status(*versions: tuple[int, str]) -> dict[str, Any]:
    return {"fresh": True,
            "servables": [{"name": "matmul", "version": v, "state": state, "ranks": []}
                          for v, state in versions]}  # fmt: skip


@pytest.fixture
def setup(tmp_path: Path) -> tuple[RepositoryWatcher, RecordingMesh, list[str]]:
    repo = tmp_path / "repo"
    export_matmul(repo, rank_size=2)
    mesh = RecordingMesh()
    mesh.start_group(load_group(repo, "matmul", 1), [])
    mesh.started.clear()
    lines: list[str] = []
    watcher = RepositoryWatcher(
        repo, cast(Mesh, mesh), UpOptions(), StatusBoard(), say=lines.append
    )
    return watcher, mesh, lines


async def test_a_new_version_waits_for_the_scheduler_then_gets_its_agents(
    setup: tuple[RepositoryWatcher, RecordingMesh, list[str]],
) -> None:
    watcher, mesh, lines = setup
    await watcher.poll()
    assert mesh.started == [] and lines == []

    export_matmul(watcher.repo, rank_size=2, version=2)
    await watcher.poll()  # no status yet: an agent of an unknown version is refused for good
    assert mesh.started == []
    assert lines == ["matmul v2: new version (2 ranks); starting its agents once the "
                     "scheduler has loaded it"]  # fmt: skip

    watcher.board.latest = _status((1, "available"))
    await watcher.poll()
    assert mesh.started == []

    watcher.board.latest = _status((1, "available"), (2, "loading"))
    await watcher.poll()
    [(key, specs)] = mesh.started
    assert key == ("matmul", 2)
    assert [s.label for s in specs] == ["agent matmul r0 v2", "agent matmul r1 v2"]
    assert all(s.argv[s.argv.index("--version") + 1] == "2" for s in specs)
    assert lines[-1] == "matmul v2: the scheduler loaded it; starting its agents"
    await watcher.poll()
    assert len(mesh.started) == 1  # once


async def test_a_removed_version_is_retired_and_others_are_untouched(
    setup: tuple[RepositoryWatcher, RecordingMesh, list[str]],
) -> None:
    watcher, mesh, lines = setup
    export_matmul(watcher.repo, rank_size=1, version=2)
    watcher.board.latest = _status((1, "available"), (2, "loading"))
    await watcher.poll()
    shutil.rmtree(watcher.repo / "matmul" / "2")
    await watcher.poll()
    assert mesh.retired == [("matmul", 2)]
    assert set(mesh.groups) == {("matmul", 1)}
    assert lines[-1].startswith("matmul v2: its folder is gone; its agents leave")


async def test_an_unloaded_version_comes_back_only_when_the_scheduler_loads_it_again(
    setup: tuple[RepositoryWatcher, RecordingMesh, list[str]],
) -> None:
    watcher, mesh, lines = setup
    mesh.refused.add(("matmul", 1))  # the scheduler unloaded v1: its agents exited 3
    watcher.board.latest = _status((1, "unloading"))
    await watcher.poll()
    assert mesh.groups == {} and mesh.started == []
    assert lines == ["matmul v1: the scheduler let its agents go (unloaded); not restarting them"]
    await watcher.poll()  # still listed (as unloading): not back
    mesh.refused.clear()
    watcher.board.latest = _status()
    await watcher.poll()  # dropped by the scheduler
    assert mesh.started == []
    watcher.board.latest = _status((1, "loading"))  # a "load" command brought it back
    await watcher.poll()
    assert [key for key, _ in mesh.started] == [("matmul", 1)]
    assert lines[-1] == "matmul v1: the scheduler loaded it again; starting its agents"


async def test_an_invalid_version_folder_is_reported_once_and_not_served(
    setup: tuple[RepositoryWatcher, RecordingMesh, list[str]],
) -> None:
    watcher, mesh, lines = setup
    folder = watcher.repo / "matmul" / "3"
    folder.mkdir()
    (folder / "group.json").write_text("{not json")
    assert ("matmul", 3) in versions_on_disk(watcher.repo)
    watcher.board.latest = _status((1, "available"), (3, "loading"))
    await watcher.poll()
    await watcher.poll()
    assert mesh.started == []
    assert len(lines) == 1 and lines[0].startswith("matmul v3: new version folder not served:")

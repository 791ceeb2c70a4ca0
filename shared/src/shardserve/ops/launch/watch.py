"""Versions added to or removed from the repository while ``shardserve up`` runs.

Every ``repository_poll_seconds`` the launcher compares the repository with what it runs
(the scheduler rescans at the same pace and loads/unloads on its side):

* a new version folder whose group.json loads and whose rank files match their sha256
  is *pending* until the scheduler lists it (an agent of a version the scheduler does not
  know yet is refused for good), then its agents start, supervised like the others; an
  invalid one is reported (again only when the reason changes) and looked at next time;
* a version folder that disappeared is *retired*: its agents are not restarted and leave
  when the scheduler, having drained the version, tells them to (exit 3), or are stopped
  after ``RETIRE_PATIENCE_S``;
* a version whose agents all left with exit 3 (the scheduler unloaded it: a
  RepositoryCommand "unload") is *released*: not restarted. If the scheduler lists it
  again later (a "load" command), its agents start again.

The other versions' agents are never touched.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from shardserve.errors import RepositoryError
from shardserve.ops.launch.plan import GroupKey, UpOptions, agent_specs, version_problem
from shardserve.ops.launch.processes import Mesh
from shardserve.ops.launch.status import Status, StatusBoard, listed_versions
from shardserve.repo.repository import GroupConfig, list_versions, load_group

# How long a removed version's agents may wait for the scheduler to let them go (it first
# finishes the version's open requests, which are bounded by their deadlines).
RETIRE_PATIENCE_S = 60.0


def versions_on_disk(repo: Path) -> set[GroupKey]:
    """(servable, version) of every version folder holding a group.json."""
    if not repo.is_dir():
        return set()
    found: set[GroupKey] = set()
    for folder in repo.iterdir():
        if folder.is_dir() and not folder.name.startswith("."):
            try:
                found.update((folder.name, v) for v in list_versions(repo, folder.name))
            except (RepositoryError, OSError):
                continue
    return found


def check_version(repo: Path, key: GroupKey) -> GroupConfig | str:
    """The version's group config when it can be served, else why not."""
    problem = version_problem(repo, *key)
    if problem is not None:
        return problem
    try:
        return load_group(repo, *key)
    except (RepositoryError, OSError) as exc:  # changed since it was checked
        return str(exc)


@dataclass
class RepositoryWatcher:
    """Keeps the mesh's agents in step with the repository (see the module doc)."""

    repo: Path
    mesh: Mesh
    options: UpOptions
    board: StatusBoard
    say: Callable[[str], None] = lambda line: print(line, flush=True)
    pending: dict[GroupKey, GroupConfig] = field(default_factory=dict)
    invalid: dict[GroupKey, str] = field(default_factory=dict)
    # released versions -> whether the scheduler has stopped listing them since
    released: dict[GroupKey, bool] = field(default_factory=dict)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.options.repository_poll_seconds)
            await self.poll()

    async def poll(self) -> None:
        on_disk = await asyncio.to_thread(versions_on_disk, self.repo)
        self.drop_removed(on_disk)
        watched = set(self.mesh.groups) | set(self.pending) | set(self.released)
        for key in sorted(on_disk - watched):
            self.note(key, await asyncio.to_thread(check_version, self.repo, key))
        status = self.board.latest
        self.note_released(status)
        if status is not None:
            self.start_listed(status)

    def drop_removed(self, on_disk: set[GroupKey]) -> None:
        for key in sorted(set(self.mesh.groups) - on_disk):
            self.say(f"{_label(key)}: its folder is gone; its agents leave once the scheduler "
                     "has drained it")  # fmt: skip
            self.mesh.retire(key, RETIRE_PATIENCE_S, self.options.grace_seconds)
        for key in sorted(set(self.pending) - on_disk):
            self.say(f"{_label(key)}: its folder is gone before its agents started")
            del self.pending[key]
        for table in (self.invalid, self.released):
            for key in set(table) - on_disk:
                del table[key]

    def note(self, key: GroupKey, checked: GroupConfig | str) -> None:
        """A version folder the mesh does not serve yet: pending, or invalid (said once)."""
        if isinstance(checked, str):
            if self.invalid.get(key) != checked:
                self.say(f"{_label(key)}: new version folder not served: {checked}")
            self.invalid[key] = checked
            return
        self.invalid.pop(key, None)
        self.pending[key] = checked
        self.say(f"{_label(key)}: new version ({checked.rank_size} ranks); starting its "
                 "agents once the scheduler has loaded it")  # fmt: skip

    def note_released(self, status: Status | None) -> None:
        listed = listed_versions(status) if status is not None else None
        for key in sorted(k for k in self.mesh.groups if self.mesh.released(k)):
            self.say(f"{_label(key)}: the scheduler let its agents go (unloaded); "
                     "not restarting them")  # fmt: skip
            self.mesh.forget(key)
            self.released[key] = False
        if listed is not None:
            for key in self.released:
                self.released[key] = self.released[key] or key not in listed

    def start_listed(self, status: Status) -> None:
        """Start the agents of pending versions the scheduler now serves, and of released
        ones it serves again after having dropped them."""
        entries = listed_versions(status)
        listed = {key for key, entry in entries.items() if entry.get("state") != "unloading"}
        for key in sorted(k for k in self.pending if k in listed):
            self._start(self.pending.pop(key), "the scheduler loaded it; starting its agents")
        for key in sorted(k for k, dropped in self.released.items() if dropped and k in listed):
            del self.released[key]
            checked = check_version(self.repo, key)
            if isinstance(checked, str):
                self.note(key, checked)
                continue
            self._start(checked, "the scheduler loaded it again; starting its agents")

    def _start(self, group: GroupConfig, why: str) -> None:
        self.say(f"{_label((group.servable, group.version))}: {why}")
        self.mesh.start_group(group, agent_specs(self.repo, group, self.options, True))


def _label(key: GroupKey) -> str:
    return f"{key[0]} v{key[1]}"

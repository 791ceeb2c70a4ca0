"""What the repository offers: servables, their versions (group.json) and their methods.

Each servable's ``servable_config.py`` is loaded in isolation: a broken one makes that
servable unavailable (its ``problem`` is the "<file>:<line>: <problem>" message) and
touches no other servable. A servable without a config gets one method, ``predict`` = the
model, with the group's inputs and outputs.

A method chains stages (see ``methods``): the distributed model and Python functions for
pre- and post-processing; it maps its own input/output names onto the model's by
position, as MindSpore's ``add_stage(model, x, ...)`` does.

A text-generation servable is marked twice, both written by ``shardserve export hf``:
group.json ``origin["task"] == "text-generation"`` (what the agents and the generation
machine read) and ``declare_servable(..., generation=True)`` in servable_config.py (no
methods). A config that says otherwise than its group.json makes the version unavailable,
with both named; a generation version without a config is served as generation.

The repository may change while the scheduler runs (``rescan``): a new version folder is
loaded (its servable's config is read again for it), a version whose group.json was
broken is retried, and a version folder that disappeared is reported as removed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from shardserve.errors import RepositoryError, ServableConfigError
from shardserve.repo.repository import (
    SERVABLE_CONFIG_FILE,
    GroupConfig,
    list_versions,
    load_group,
)
from shardserve.servable import (
    GENERATION_TASK,
    ServableDefinition,
    load_servable_config,
)
from shardserve_scheduler.core.methods import (
    DEFAULT_METHOD,
    MethodPlan,
    default_method,
    plan_method,
)

__all__ = [
    "GENERATION_TASK",
    "Catalog",
    "MethodPlan",
    "ServableEntry",
    "VersionEntry",
    "default_method",
    "is_generation",
]

_logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class VersionEntry:
    """One version of a servable: its group, its usable methods, and why others are not."""

    group: GroupConfig
    methods: dict[str, MethodPlan] = field(default_factory=dict)
    unsupported: dict[str, str] = field(default_factory=dict)
    problem: str = ""

    @property
    def generation(self) -> bool:
        """A text-generation servable: GenerateRequests, sequences stepped over the mesh."""
        return is_generation(self.group)


def is_generation(group: GroupConfig) -> bool:
    return group.origin.get("task") == GENERATION_TASK


@dataclass(frozen=True)
class ServableEntry:
    name: str
    versions: dict[int, VersionEntry] = field(default_factory=dict)
    broken_versions: dict[int, str] = field(default_factory=dict)
    problem: str = ""

    def all_versions(self) -> list[int]:
        return sorted(set(self.versions) | set(self.broken_versions))


GroupKey = tuple[str, int]


@dataclass
class Catalog:
    servables: dict[str, ServableEntry]
    # versions draining before they are dropped (explicit requests for them are refused)
    unloading: set[GroupKey] = field(default_factory=set)

    def groups(self) -> list[GroupConfig]:
        """Every loadable group (servable, version) of the repository."""
        return [v.group for s in self.servables.values() for v in s.versions.values()]

    def entry(self, key: GroupKey) -> VersionEntry | None:
        servable = self.servables.get(key[0])
        return servable.versions.get(key[1]) if servable else None

    def drop(self, key: GroupKey) -> None:
        """Forget a version (unloaded); a servable left with no version disappears."""
        self.unloading.discard(key)
        servable = self.servables.get(key[0])
        if servable is None:
            return
        servable.versions.pop(key[1], None)
        servable.broken_versions.pop(key[1], None)
        if not servable.versions and not servable.broken_versions:
            del self.servables[key[0]]


def log_catalog(catalog: Catalog) -> None:
    """One line per served version, at start."""
    for servable in catalog.servables.values():
        for version, entry in sorted(servable.versions.items()):
            group = entry.group
            methods = ", ".join(sorted(entry.methods)) or "none"
            if entry.generation:
                methods = "none (text generation: generate requests)"
            _logger.info(
                "%s v%d: rank_size %d, stage_size %d, methods: %s",
                servable.name,
                version,
                group.rank_size,
                group.stage_size,
                methods,
            )


def load_catalog(repo: Path) -> Catalog:
    """Read every servable of the repository; problems are logged at ERROR, never raised."""
    if not repo.is_dir():
        raise RepositoryError(f"model repository {repo} does not exist")
    servables: dict[str, ServableEntry] = {}
    for folder in sorted(p for p in repo.iterdir() if p.is_dir() and not p.name.startswith(".")):
        versions = list_versions(repo, folder.name)
        if versions:
            servables[folder.name] = load_servable(repo, folder.name, versions)
    return Catalog(servables)


def load_servable(repo: Path, name: str, versions: list[int]) -> ServableEntry:
    definition, problem = load_definition(repo / name / SERVABLE_CONFIG_FILE)
    if problem:
        _logger.error("servable %s is unavailable: %s", name, problem)
    loaded: dict[int, VersionEntry] = {}
    broken: dict[int, str] = {}
    for version in versions:
        try:
            group = load_group(repo, name, version)
        except RepositoryError as exc:
            _logger.error("servable %s version %d is unavailable: %s", name, version, exc)
            broken[version] = str(exc)
            continue
        if problem:  # listed (so status shows why), but serves nothing
            loaded[version] = VersionEntry(group, problem=problem)
        else:
            loaded[version] = build_version(group, definition)
    return ServableEntry(name, loaded, broken, problem)


def load_definition(path: Path) -> tuple[ServableDefinition | None, str]:
    if not path.is_file():
        return None, ""
    try:
        return load_servable_config(path), ""
    except ServableConfigError as exc:
        return None, str(exc)


def build_version(group: GroupConfig, definition: ServableDefinition | None) -> VersionEntry:
    """The methods of one version: the default ``predict``, or the config's methods; none
    for a text-generation version (it serves GenerateRequests)."""
    if definition is None:
        if is_generation(group):
            return VersionEntry(group)
        return VersionEntry(group, {DEFAULT_METHOD: default_method(group)})
    problem = _model_mismatch(group, definition) or _generation_mismatch(group, definition)
    if problem:
        _logger.error("%s", problem)
        return VersionEntry(group, problem=problem)
    methods: dict[str, MethodPlan] = {}
    unsupported: dict[str, str] = {}
    for name, method in definition.methods.items():
        try:
            methods[name] = plan_method(group, method, definition.model)
        except ValueError as exc:
            unsupported[name] = str(exc)
            _logger.error(
                "%s: method %r of %s v%d is unavailable: %s",
                definition.path,
                name,
                group.servable,
                group.version,
                exc,
            )
    return VersionEntry(group, methods, unsupported)


def _model_mismatch(group: GroupConfig, definition: ServableDefinition) -> str:
    model = definition.model
    assert model is not None  # load_servable_config guarantees it
    if (model.rank_size, model.stage_size) == (group.rank_size, group.stage_size):
        return ""
    return (
        f"{definition.path} declares rank_size {model.rank_size}, stage_size {model.stage_size}; "
        f"group.json of {group.servable} v{group.version} has rank_size {group.rank_size}, "
        f"stage_size {group.stage_size}"
    )


def _generation_mismatch(group: GroupConfig, definition: ServableDefinition) -> str:
    """The config and group.json must agree on whether this is a text-generation servable."""
    marked = is_generation(group)
    if definition.generation == marked:
        return ""
    task = group.origin.get("task")
    found = f'origin task "{task}"' if task else "no origin task"
    if marked:
        return (
            f"{definition.path} declares a servable with methods, but group.json of "
            f"{group.servable} v{group.version} marks a text-generation servable "
            f'(origin task "{GENERATION_TASK}"): declare_servable(..., generation=True) and '
            "no methods, as `shardserve export hf` writes it (re-export to rewrite it)"
        )
    return (
        f"{definition.path} declares a text-generation servable (generation=True), but "
        f"group.json of {group.servable} v{group.version} has {found}, not "
        f'"{GENERATION_TASK}": it was not exported by `shardserve export hf`'
    )

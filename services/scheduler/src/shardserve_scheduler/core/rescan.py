"""Keeping the catalog in step with the repository while the scheduler runs.

``scan`` reads the disk (it may run in a worker thread): version folders the catalog does
not serve yet are loaded (their servable's config is executed again, for them only), a
version whose group.json was broken is retried, and served versions whose folder is gone
are reported. ``apply`` merges the result into the catalog (on the event loop). Versions
the operator unloaded (``held_back``) are not brought back by a scan, only by a ``load``
command. A broken config or group.json only affects its own servable/version.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from shardserve.errors import RepositoryError
from shardserve.repo.repository import SERVABLE_CONFIG_FILE, GroupConfig, list_versions, load_group
from shardserve_scheduler.core.catalog import (
    Catalog,
    GroupKey,
    ServableEntry,
    VersionEntry,
    build_version,
    load_definition,
)

_logger = logging.getLogger(__name__)


@dataclass
class ScanResult:
    loaded: dict[GroupKey, VersionEntry] = field(default_factory=dict)
    broken: dict[GroupKey, str] = field(default_factory=dict)
    removed: list[GroupKey] = field(default_factory=list)


def on_disk(repo: Path) -> dict[str, list[int]]:
    """servable -> versions with a group.json, for every servable folder of the repository."""
    if not repo.is_dir():
        return {}
    found: dict[str, list[int]] = {}
    for folder in sorted(p for p in repo.iterdir() if p.is_dir() and not p.name.startswith(".")):
        try:
            found[folder.name] = list_versions(repo, folder.name)
        except (RepositoryError, OSError):
            continue
    return found


def scan(
    repo: Path,
    served: set[GroupKey],
    broken: dict[GroupKey, str],
    held_back: set[GroupKey],
) -> ScanResult:
    """What changed on disk relative to the ``served`` (and ``broken``) versions."""
    result = ScanResult()
    disk = on_disk(repo)
    present = {(name, v) for name, versions in disk.items() for v in versions}
    result.removed = sorted(key for key in served | set(broken) if key not in present)
    for name, versions in disk.items():
        new = [v for v in versions if (name, v) not in served and (name, v) not in held_back]
        if new:
            _load_new(repo, name, new, broken, result)
    return result


def _load_new(
    repo: Path, name: str, versions: list[int], known_broken: dict[GroupKey, str], out: ScanResult
) -> None:
    definition, problem = load_definition(repo / name / SERVABLE_CONFIG_FILE)
    for version in versions:
        key = (name, version)
        try:
            group: GroupConfig = load_group(repo, name, version)
        except RepositoryError as exc:
            out.broken[key] = str(exc)
            if known_broken.get(key) != str(exc):
                _logger.error("servable %s version %d is unavailable: %s", name, version, exc)
            continue
        if problem:
            _logger.error("servable %s version %d is unavailable: %s", name, version, problem)
            out.loaded[key] = VersionEntry(group, problem=problem)
        else:
            out.loaded[key] = build_version(group, definition)


def served_keys(catalog: Catalog) -> set[GroupKey]:
    return {(s.name, v) for s in catalog.servables.values() for v in s.versions}


def broken_keys(catalog: Catalog) -> dict[GroupKey, str]:
    return {
        (s.name, v): why for s in catalog.servables.values() for v, why in s.broken_versions.items()
    }


def apply(catalog: Catalog, result: ScanResult) -> list[GroupConfig]:
    """Merge newly loaded and still-broken versions; return the groups that are new."""
    for (name, version), why in result.broken.items():
        _servable(catalog, name).broken_versions[version] = why
    added: list[GroupConfig] = []
    for (name, version), entry in sorted(result.loaded.items()):
        servable = _servable(catalog, name)
        servable.broken_versions.pop(version, None)
        servable.versions[version] = entry
        added.append(entry.group)
    return added


def _servable(catalog: Catalog, name: str) -> ServableEntry:
    if name not in catalog.servables:
        catalog.servables[name] = ServableEntry(name)
    return catalog.servables[name]

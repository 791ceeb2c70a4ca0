"""The servable lookup both request kinds share: servable, version, group readiness.

Version 0 means the highest READY version; an explicit version must exist. Every refusal
is an InferenceError whose message says what was asked and what exists, so an inference
request and a generation request asking for the same missing thing read the same answer.
"""

from __future__ import annotations

from shardserve.errors import NotFoundError, UnavailableError
from shardserve_scheduler.core.catalog import Catalog, ServableEntry, VersionEntry
from shardserve_scheduler.core.registry import Registry


def find_version(catalog: Catalog, registry: Registry, name: str, version: int) -> VersionEntry:
    """The version a request for ``name`` v``version`` runs on (not yet checked ready)."""
    servable = catalog.servables.get(name)
    if servable is None:
        known = ", ".join(sorted(catalog.servables)) or "none"
        raise NotFoundError(f"servable {name!r} not found; servables: {known}")
    if servable.problem:
        raise UnavailableError(f"servable {servable.name} is unavailable: {servable.problem}")
    if version == 0:
        return _highest_ready(catalog, servable, registry)
    return _explicit(catalog, servable, version)


def check_group_ready(registry: Registry, entry: VersionEntry) -> None:
    """Refuse, naming the missing ranks, unless the version's group is ready."""
    group = registry.group(entry.group.servable, entry.group.version)
    if group is None:  # the registry is built from the same catalog; defensive only
        raise UnavailableError(f"{entry.group.servable} v{entry.group.version} has no group")
    if not group.ready:
        raise UnavailableError(group.not_ready_reason())


def _explicit(catalog: Catalog, servable: ServableEntry, version: int) -> VersionEntry:
    if (servable.name, version) in catalog.unloading:
        raise UnavailableError(
            f"servable {servable.name} version {version} is unloading; it takes no new requests"
        )
    if version in servable.broken_versions:
        raise UnavailableError(
            f"servable {servable.name} version {version} is unavailable: "
            f"{servable.broken_versions[version]}"
        )
    entry = servable.versions.get(version)
    if entry is None:
        listed = ", ".join(str(v) for v in servable.all_versions())
        raise NotFoundError(
            f"servable {servable.name} version {version} not found; versions: {listed}"
        )
    return entry


def _highest_ready(catalog: Catalog, servable: ServableEntry, registry: Registry) -> VersionEntry:
    """The highest version whose group is ready (unloading ones skipped); if none is, the
    highest one (refused later by the readiness check with the missing ranks named)."""
    candidates = [v for v in servable.versions if (servable.name, v) not in catalog.unloading]
    if not candidates:
        reasons = "; ".join(servable.broken_versions.values()) or "every version is unloading"
        raise UnavailableError(f"servable {servable.name} has no loadable version: {reasons}")
    for version in sorted(candidates, reverse=True):
        entry = servable.versions[version]
        group = registry.group(servable.name, version)
        if group is not None and group.ready and not entry.problem:
            return entry
    return servable.versions[max(candidates)]

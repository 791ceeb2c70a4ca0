"""The MeshStatus the scheduler broadcasts: every servable version, its methods, its ranks."""

from __future__ import annotations

from collections.abc import Callable

from shardserve.protocol import MeshStatus, MethodStatus, ServableStatus
from shardserve_scheduler.catalog import Catalog, ServableEntry, VersionEntry
from shardserve_scheduler.registry import Registry

InflightOf = Callable[[str, int], int]


def mesh_status(
    scheduler: str, catalog: Catalog, registry: Registry, inflight: InflightOf, now: float
) -> MeshStatus:
    servables = [
        _version_status(servable, entry, registry, inflight, now)
        for servable in catalog.servables.values()
        for _, entry in sorted(servable.versions.items())
    ]
    return MeshStatus(scheduler=scheduler, time=now, servables=tuple(servables))


def _version_status(
    servable: ServableEntry,
    entry: VersionEntry,
    registry: Registry,
    inflight: InflightOf,
    now: float,
) -> ServableStatus:
    config = entry.group
    group = registry.group(config.servable, config.version)
    ranks = tuple(slot.status(now) for slot in group.slots) if group else ()
    problem = servable.problem or entry.problem
    ready = bool(group and group.ready) and not problem
    reason = problem or (group.not_ready_reason() if group else "no group")
    methods = (
        tuple(
            MethodStatus(name=m.name, inputs=m.inputs, outputs=m.outputs)
            for m in entry.methods.values()
        )
        if not problem
        else ()
    )
    return ServableStatus(
        name=config.servable,
        version=config.version,
        ready=ready,
        reason="" if ready else reason,
        rank_size=config.rank_size,
        stage_size=config.stage_size,
        with_batch_dim=config.with_batch_dim,
        max_batch_size=config.max_batch_size,
        methods=methods,
        ranks=ranks,
        inflight=inflight(config.servable, config.version),
    )

"""The MeshStatus the scheduler broadcasts: every servable version, its methods, its ranks,
its load and its counters."""

from __future__ import annotations

from typing import Literal, Protocol

from shardserve.repo.repository import GroupConfig
from shardserve.text.token_bound import ORIGIN_KEY, prompt_bytes_limit
from shardserve.wire.protocol import MeshStatus, MethodStatus, ServableStatus
from shardserve_scheduler.core.catalog import Catalog, ServableEntry, VersionEntry
from shardserve_scheduler.core.generation.lanes import GenerationStats
from shardserve_scheduler.core.jobs import VersionStats
from shardserve_scheduler.core.registry import GroupState, Registry

VersionState = Literal["loading", "available", "unloading", "failed"]


class LoadView(Protocol):
    """What the status needs from the request machine."""

    def inflight(self, servable: str, version: int) -> int: ...
    def queued(self, servable: str, version: int) -> int: ...
    def version_stats(self, servable: str, version: int) -> VersionStats: ...


class GenerationView(Protocol):
    """What the status needs from the generation machine."""

    def running(self, servable: str, version: int) -> int: ...
    def waiting(self, servable: str, version: int) -> int: ...
    def stats(self, servable: str, version: int) -> GenerationStats: ...


def mesh_status(
    scheduler: str,
    catalog: Catalog,
    registry: Registry,
    load: LoadView,
    now: float,
    *,
    generation: GenerationView | None = None,
    dead_lettered: int = 0,
    request_queue_depth: int = 0,
) -> MeshStatus:
    servables = [
        _with_generation(_version_status(servable, entry, catalog, registry, load, now), generation)
        for servable in catalog.servables.values()
        for _, entry in sorted(servable.versions.items())
    ]
    return MeshStatus(
        scheduler=scheduler,
        time=now,
        servables=tuple(servables),
        dead_lettered=dead_lettered,
        request_queue_depth=request_queue_depth,
    )


def _version_status(
    servable: ServableEntry,
    entry: VersionEntry,
    catalog: Catalog,
    registry: Registry,
    load: LoadView,
    now: float,
) -> ServableStatus:
    config = entry.group
    group = registry.group(config.servable, config.version)
    ranks = tuple(slot.status(now) for slot in group.slots) if group else ()
    problem = servable.problem or entry.problem
    unloading = (config.servable, config.version) in catalog.unloading
    ready = bool(group and group.ready) and not problem and not unloading
    reason = problem or (group.not_ready_reason() if group else "no group")
    if unloading:
        reason = f"{config.servable} v{config.version} is unloading"
    methods = (
        tuple(
            MethodStatus(name=m.name, inputs=m.inputs, outputs=m.outputs)
            for m in entry.methods.values()
        )
        if not problem
        else ()
    )
    stats = load.version_stats(config.servable, config.version)
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
        inflight=load.inflight(config.servable, config.version),
        queued=load.queued(config.servable, config.version),
        requests_total=stats.requests_total,
        errors_total=stats.errors_total,
        batches_total=stats.batches_total,
        batched_instances_total=stats.batched_instances_total,
        state=_state(problem, unloading, ready, group),
        generation=entry.generation,
        prompt_bytes_limit=_prompt_bytes_limit(config) if entry.generation else None,
    )


def _prompt_bytes_limit(group: GroupConfig) -> int | None:
    """The text prompt size past which the version surely refuses (the origin's context and
    tokenizer bound, written at export); None when either is missing."""
    context, per_token = group.origin.get("max_positions"), group.origin.get(ORIGIN_KEY)
    if type(context) is not int or type(per_token) is not int or context < 1 or per_token < 1:
        return None
    return prompt_bytes_limit(context, per_token)


def _with_generation(status: ServableStatus, view: GenerationView | None) -> ServableStatus:
    """A text-generation version's sequences and token totals."""
    if view is None or not status.generation:
        return status
    name, version = status.name, status.version
    stats = view.stats(name, version)
    return status.model_copy(
        update={
            "running_sequences": view.running(name, version),
            "waiting_sequences": view.waiting(name, version),
            "prompt_tokens_total": stats.prompt_tokens_total,
            "generated_tokens_total": stats.generated_tokens_total,
            "requests_total": status.requests_total + stats.requests_total,
            "errors_total": status.errors_total + stats.errors_total,
        }
    )


def _state(problem: str, unloading: bool, ready: bool, group: GroupState | None) -> VersionState:
    if problem:
        return "failed"
    if unloading:
        return "unloading"
    return "available" if ready or (group and group.was_complete) else "loading"

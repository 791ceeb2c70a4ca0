"""From an InferRequest to a Call: servable, version, method, and validated instances.

Version 0 means the highest READY version; an explicit version must exist. Every refusal
is an InferenceError whose message says what was asked and what exists.
"""

from __future__ import annotations

from shardserve.errors import BadInputError, InferenceError, NotFoundError, UnavailableError
from shardserve.repo.signature import check_instance
from shardserve.wire.protocol import InferRequest
from shardserve_scheduler.core.catalog import Catalog, MethodPlan, ServableEntry, VersionEntry
from shardserve_scheduler.core.registry import Registry
from shardserve_scheduler.core.requests import Call


def resolve(
    catalog: Catalog,
    registry: Registry,
    request: InferRequest,
    reply_to: str,
    correlation_id: str,
) -> Call:
    """Resolve and validate a request, or raise the InferenceError that answers it."""
    servable = catalog.servables.get(request.servable)
    if servable is None:
        known = ", ".join(sorted(catalog.servables)) or "none"
        raise NotFoundError(f"servable {request.servable!r} not found; servables: {known}")
    if servable.problem:
        raise UnavailableError(f"servable {servable.name} is unavailable: {servable.problem}")
    entry = _pick_version(catalog, servable, registry, request.version)
    method = _pick_method(servable.name, entry, request.method)
    _check_group_ready(registry, entry)
    _validate(request, method, batch_dim=entry.group.with_batch_dim)
    return Call(request, reply_to, correlation_id, entry.group, method)


def _pick_version(
    catalog: Catalog, servable: ServableEntry, registry: Registry, version: int
) -> VersionEntry:
    if version == 0:
        return _highest_ready(catalog, servable, registry)
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


def _pick_method(servable: str, entry: VersionEntry, method: str) -> MethodPlan:
    if entry.problem:
        raise UnavailableError(
            f"servable {servable} version {entry.group.version} is unavailable: {entry.problem}"
        )
    plan = entry.methods.get(method)
    if plan is not None:
        return plan
    if entry.generation:
        raise BadInputError(
            f"servable {servable} is a text-generation servable: use /v1/completions, "
            f"/v1/chat/completions or /v2/models/{servable}/generate"
        )
    if method in entry.unsupported:
        raise UnavailableError(
            f"method {method!r} of servable {servable} is unavailable: {entry.unsupported[method]}"
        )
    known = ", ".join(sorted(entry.methods)) or "none"
    raise NotFoundError(f"method {method!r} not found for servable {servable}; methods: {known}")


def _check_group_ready(registry: Registry, entry: VersionEntry) -> None:
    group = registry.group(entry.group.servable, entry.group.version)
    if group is None:  # the registry is built from the same catalog; defensive only
        raise UnavailableError(f"{entry.group.servable} v{entry.group.version} has no group")
    if not group.ready:
        raise UnavailableError(group.not_ready_reason())


def _validate(request: InferRequest, method: MethodPlan, *, batch_dim: bool) -> None:
    for index, instance in enumerate(request.instances):
        try:
            check_instance(instance, method.inputs, batch_dim=batch_dim)
            for tensor in instance.values():
                tensor.to_numpy()  # data length must fit shape and dtype (no copy)
        except InferenceError as exc:
            prefix = f"instance {index}: " if len(request.instances) > 1 else ""
            raise BadInputError(f"{prefix}{exc.message}") from exc
    if request.outputs:
        unknown = [n for n in request.outputs if n not in method.output_names]
        if unknown:
            raise BadInputError(
                f"unknown output(s) {', '.join(unknown)}; outputs of "
                f"{method.name}: {', '.join(method.output_names)}"
            )

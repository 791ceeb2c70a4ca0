"""From an InferRequest to a Call: servable, version, method, and validated instances.

The servable and version are found as for every request (``lookup``); the method and the
instances are this kind's own. Every refusal is an InferenceError whose message says what
was asked and what exists.
"""

from __future__ import annotations

from shardserve.errors import BadInputError, InferenceError, NotFoundError, UnavailableError
from shardserve.repo.signature import check_instance
from shardserve.wire.protocol import InferRequest
from shardserve_scheduler.core.catalog import Catalog, MethodPlan, VersionEntry
from shardserve_scheduler.core.lookup import check_group_ready, find_version
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
    entry = find_version(catalog, registry, request.servable, request.version)
    method = _pick_method(entry.group.servable, entry, request.method)
    check_group_ready(registry, entry)
    _validate(request, method, batch_dim=entry.group.with_batch_dim)
    return Call(request, reply_to, correlation_id, entry.group, method)


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

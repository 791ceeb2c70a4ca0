"""KServe v2 model repository extension (``"model_repository"`` in ``GET /v2``).

- ``POST /v2/repository/index``: every servable version the scheduler reports, as
  ``[{"name", "version", "state", "reason"}]``; body ``{"ready": true}`` keeps only the
  ready ones. States follow Triton: READY, LOADING, UNLOADING, UNAVAILABLE.
- ``POST /v2/repository/models/{m}/load`` and ``.../unload``: publish a
  ``RepositoryCommand`` to the scheduler (publisher-confirmed, so "no scheduler is
  running" is a 503, not a silent drop) and answer ``{"name": m, "load": true}`` /
  ``{"name": m, "unload": true}``, as KServe's model server does.

The command is asynchronous, as in Triton's non-blocking mode: 200 means the scheduler
took it; the version then shows ``LOADING``/``UNLOADING`` in the index and readiness until
it is done. ``m`` is a servable name (a ``:method`` suffix is refused: methods are not
loaded on their own). Parameter ``version`` (a positive integer) targets one version;
without it every version of the servable is meant. Triton's ``config`` and ``file:*``
parameters (uploading a model) are refused with 400: slices come from the repository.
Unloading a servable the status does not know is a 404; a load is not checked here, since
a servable that is not loaded is, rightly, not in the status.
"""

from __future__ import annotations

from typing import Any, Literal

from aiohttp import web

from shardserve.errors import BadInputError, NotFoundError
from shardserve.process.integers import parse_positive_int
from shardserve.wire.control import MAX_SERVABLE_NAME
from shardserve.wire.protocol import RepositoryCommand, ServableStatus
from shardserve_gateway.codecs.body import read_body
from shardserve_gateway.codecs.kserve import parse_json_object
from shardserve_gateway.mesh_view import METHOD_SEPARATOR
from shardserve_gateway.responses import json_response
from shardserve_gateway.state import DISPATCHER_KEY, MESH_VIEW_KEY, SETTINGS_KEY

EXTENSION = "model_repository"
MAX_COMMAND_BODY = 64 * 1024

Action = Literal["load", "unload"]


def add_routes(app: web.Application) -> None:
    """Register the repository extension routes."""
    app.router.add_post("/v2/repository/index", index)
    app.router.add_post("/v2/repository/models/{model}/load", load)
    app.router.add_post("/v2/repository/models/{model}/unload", unload)


async def index(request: web.Request) -> web.Response:
    body = await _json_body(request)
    ready_only = body.get("ready", False)
    if not isinstance(ready_only, bool):
        raise BadInputError(f"'ready' must be true or false, got {ready_only!r}")
    return json_response(index_entries(request.app, ready_only=ready_only))


def index_entries(app: web.Application, *, ready_only: bool) -> list[dict[str, str]]:
    """The repository index: every servable version (or only the ready ones)."""
    status = app[MESH_VIEW_KEY].require_fresh()
    entries = sorted(status.servables, key=lambda s: (s.name, s.version))
    return [index_entry(s) for s in entries if s.ready or not ready_only]


def index_entry(servable: ServableStatus) -> dict[str, str]:
    """One index row: Triton's state names, the reason when it is not ready."""
    return {
        "name": servable.name,
        "version": str(servable.version),
        "state": triton_state(servable),
        "reason": "" if servable.ready else servable.reason,
    }


def triton_state(servable: ServableStatus) -> str:
    """READY / LOADING / UNLOADING / UNAVAILABLE."""
    if servable.state == "unloading":
        return "UNLOADING"
    if servable.ready:
        return "READY"
    if servable.state == "loading":
        return "LOADING"
    return "UNAVAILABLE"


async def load(request: web.Request) -> web.Response:
    return await _command(request, "load")


async def unload(request: web.Request) -> web.Response:
    return await _command(request, "unload")


async def _command(request: web.Request, action: Action) -> web.Response:
    model = request.match_info["model"]
    await send_command(request.app, action, model, await _json_body(request))
    return json_response({"name": model, action: True})


async def send_command(
    app: web.Application, action: Action, model: str, body: dict[str, Any]
) -> None:
    """Check and publish a load/unload command (REST body or gRPC parameters as
    ``{"parameters": {...}}``)."""
    if METHOD_SEPARATOR in model:
        raise BadInputError(
            f"{action} takes a servable name, not a method: use "
            f"{model.partition(METHOD_SEPARATOR)[0]!r}"
        )
    if not 0 < len(model) <= MAX_SERVABLE_NAME:  # (gRPC's model_name may be empty)
        raise BadInputError(
            f"{action} takes a servable name of 1-{MAX_SERVABLE_NAME} characters, got {len(model)}"
        )
    version = command_version(body)
    if action == "unload":
        _require_known(app, model, version)
    command = RepositoryCommand(action=action, servable=model, version=version)
    await app[DISPATCHER_KEY].command(command)


def command_version(body: dict[str, Any]) -> int:
    """The ``version`` parameter (0 = every version); upload parameters are refused."""
    params = body.get("parameters") or {}
    if not isinstance(params, dict):
        raise BadInputError("'parameters' must be a JSON object")
    for key in params:
        if key == "config" or key.startswith("file:"):
            raise BadInputError(
                f"parameter {key!r} is not supported: models are loaded from the "
                "scheduler's repository, not uploaded"
            )
    raw = params.get("version", 0)
    version = parse_positive_int(raw, zero_allowed=True) if isinstance(raw, str) else raw
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise BadInputError(
            f"parameter 'version' must be a positive integer (a number or ASCII digits), "
            f"got {raw!r}"
        )
    return version


def _require_known(app: web.Application, model: str, version: int) -> None:
    view = app[MESH_VIEW_KEY]
    versions = view.versions_of(model)  # 404 for an unknown servable
    if version and version not in {s.version for s in versions}:
        known = [s.version for s in versions]
        raise NotFoundError(f"unknown version {version} of model {model!r}; known: {known}")


async def _json_body(request: web.Request) -> dict[str, Any]:
    """The optional JSON object body (empty body = ``{}``)."""
    limit = min(MAX_COMMAND_BODY, request.app[SETTINGS_KEY].max_body_bytes)
    raw = await read_body(request, limit)
    if not raw.strip():
        return {}
    return parse_json_object(raw)

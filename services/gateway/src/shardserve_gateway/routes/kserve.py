"""KServe v2 / Open Inference Protocol REST routes.

Routes: ``GET /v2`` and ``/v2/`` (server metadata), ``/v2/health/live``,
``/v2/health/ready``, ``/v2/models`` (list), ``/v2/models/{m}[/versions/{v}]``
(metadata), ``.../ready``, ``POST .../infer``.

Methods other than the default (``predict``): **the model name selects the method**,
``<servable>:<method>`` — e.g. ``POST /v2/models/matmul:predict_softmax/infer``. Why the
name and not a request parameter: in the Open Inference Protocol a model has ONE
signature (its metadata lists one set of inputs/outputs), and a servable's methods have
different signatures. As separate model names every method gets correct metadata,
readiness and infer through any unmodified OIP client (tritonclient quotes the ``:`` and
we decode it). ``:`` cannot occur in a method name (a Python identifier) and matches the
MindSpore REST URL form ``/model/<servable>:<method>``. A request parameter ``method`` is
refused with a 400 that points here, so a client cannot silently run the wrong method.

Validation happens before anything is published: unknown model/version/method -> 404,
stale mesh status or unready version -> 503, bad body or signature mismatch -> 400.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiohttp import web

import shardserve
from shardserve.errors import BadInputError, ErrorCode, InternalError, error_for
from shardserve.process.integers import POSITIVE_INT_RULE, parse_positive_int
from shardserve.process.lifecycle import request_id_var
from shardserve.repo.signature import check_instance
from shardserve.wire.protocol import InferReply, InferRequest, TensorSpec
from shardserve.wire.tensors import Tensor
from shardserve_gateway.codecs.body import read_body
from shardserve_gateway.codecs.kserve import (
    HEADER_LENGTH,
    KServeRequest,
    RequestedOutput,
    decode_request,
    encode_response,
)
from shardserve_gateway.dispatch import choose_timeout
from shardserve_gateway.mesh_view import (
    METHOD_SEPARATOR,
    Target,
    default_method,
    find_method,
    require_ready,
    split_model_name,
)
from shardserve_gateway.responses import error_response, json_response
from shardserve_gateway.state import (
    DISPATCHER_KEY,
    INFER_LABELS_KEY,
    MESH_VIEW_KEY,
    SETTINGS_KEY,
    UNKNOWN_LABELS,
    refuse_while_draining,
)

SERVER_NAME = "shardserve"
PLATFORM = "onnxruntime_onnx"
EXTENSIONS = ("binary_tensor_data", "model_repository")
THREAD_DECODE_BYTES = 1024 * 1024  # decode bigger bodies off the event loop
TIMEOUT_HEADER = "X-Request-Timeout"


def add_routes(app: web.Application) -> None:
    """Register the KServe v2 routes."""
    models = "/v2/models/{model}"
    versioned = "/v2/models/{model}/versions/{version}"
    app.router.add_get("/v2", server_metadata)
    app.router.add_get("/v2/", server_metadata)
    app.router.add_get("/v2/health/live", live)
    app.router.add_get("/v2/health/ready", ready)
    app.router.add_get("/v2/models", list_models)
    for base in (models, versioned):
        app.router.add_get(base, model_metadata)
        app.router.add_get(base + "/ready", model_ready)
        app.router.add_post(base + "/infer", infer)


async def server_metadata(request: web.Request) -> web.Response:
    return json_response(
        {"name": SERVER_NAME, "version": shardserve.__version__, "extensions": list(EXTENSIONS)}
    )


async def live(request: web.Request) -> web.Response:
    return json_response({"live": True})


async def ready(request: web.Request) -> web.Response:
    reasons = not_ready_reasons(request.app)
    if reasons:
        return error_response(503, "not ready: " + "; ".join(reasons), code=ErrorCode.UNAVAILABLE)
    return json_response({"ready": True})


def not_ready_reasons(app: web.Application) -> list[str]:
    """Why the server is not ready (empty when it is)."""
    reasons = app[MESH_VIEW_KEY].not_ready_reasons()
    if not app[DISPATCHER_KEY].available:
        reasons.insert(0, "message broker is unreachable")
    return reasons


async def list_models(request: web.Request) -> web.Response:
    status = request.app[MESH_VIEW_KEY].require_fresh()
    names: dict[str, None] = {}
    for servable in status.servables:
        names[servable.name] = None
        default = default_method(servable).name if servable.methods else ""
        for method in servable.methods:
            if method.name != default:
                names[f"{servable.name}{METHOD_SEPARATOR}{method.name}"] = None
    return json_response({"models": list(names)})


def parse_version(raw: str | None) -> int:
    """A URL version: absent -> 0 (highest ready), else a positive integer."""
    if raw is None:
        return 0
    version = parse_positive_int(raw)
    if version is None:
        raise BadInputError(f"model version must be {POSITIVE_INT_RULE}, got {raw!r}")
    return version


async def model_metadata(request: web.Request) -> web.Response:
    model = request.match_info["model"]
    return json_response(metadata(request.app, model, request.match_info.get("version")))


def metadata(app: web.Application, model: str, version: str | None) -> dict[str, Any]:
    """A model's metadata document (REST body; gRPC copies it into its message)."""
    view = app[MESH_VIEW_KEY]
    target = view.resolve(model, parse_version(version))
    versions = view.versions_of(target.servable.name)
    batch = target.servable.with_batch_dim
    return {
        "name": model,
        "versions": [str(s.version) for s in versions],
        "platform": PLATFORM,
        "inputs": [_tensor_metadata(s, batch) for s in target.method.inputs],
        "outputs": [_tensor_metadata(s, batch) for s in target.method.outputs],
    }


def _tensor_metadata(spec: TensorSpec, batch_dim: bool) -> dict[str, Any]:
    shape = list(spec.shape)
    if batch_dim and shape:
        shape[0] = -1
    return {"name": spec.name, "datatype": spec.datatype, "shape": shape}


async def model_ready(request: web.Request) -> web.Response:
    model = request.match_info["model"]
    require_model_ready(request.app, model, request.match_info.get("version"))
    return json_response({"name": model, "ready": True})


def require_model_ready(app: web.Application, model: str, version: str | None) -> None:
    """Any servable version, a generation one too (it has no method to resolve): 404 for
    an unknown model, 503 naming why a known one is not ready."""
    servable_name, method_name = split_model_name(model)
    servable = app[MESH_VIEW_KEY].find_servable(servable_name, parse_version(version))
    if method_name is not None:
        find_method(servable, method_name)
    require_ready(servable)


async def infer(request: web.Request) -> web.Response:
    started = time.time()
    request[INFER_LABELS_KEY] = UNKNOWN_LABELS
    app = request.app
    target = infer_target(app, request.match_info["model"], request.match_info.get("version"))
    request[INFER_LABELS_KEY] = (target.servable.name, target.method.name)
    require_ready(target.servable)
    body = await read_body(request, app[SETTINGS_KEY].max_body_bytes)
    parsed = await _decode(body, request.headers.get(HEADER_LENGTH))
    outputs = await run_infer(app, parsed, target, request.headers.get(TIMEOUT_HEADER), started)
    encoded = encode_response(
        model_name=request.match_info["model"],
        model_version=request.match_info.get("version"),
        request_id=parsed.id,
        outputs=outputs,
    )
    return web.Response(
        body=encoded.body, content_type=encoded.content_type, headers=encoded.headers
    )


def infer_target(app: web.Application, model: str, version: str | None) -> Target:
    """The servable version and method an inference request names (503 while draining,
    404 for what the mesh does not know); every transport starts here."""
    refuse_while_draining(app)
    return app[MESH_VIEW_KEY].resolve(model, parse_version(version))


async def run_infer(
    app: web.Application,
    parsed: KServeRequest,
    target: Target,
    timeout_header: str | None,
    started: float,
) -> list[tuple[str, Tensor, bool]]:
    """Validate a decoded request against its target, send it to the mesh and return the
    outputs to answer with: what REST and gRPC both do once the request is decoded."""
    _validate(parsed, target)
    settings = app[SETTINGS_KEY]
    timeout = choose_timeout(
        timeout_header,
        parsed.timeout_ms,
        default_s=settings.default_timeout_s,
        max_s=settings.max_timeout_s,
    )
    reply = await app[DISPATCHER_KEY].call(_infer_request(parsed, target, started + timeout))
    return _select_outputs(_reply_outputs(reply), parsed, target)


async def _decode(body: bytes, header_length: str | None) -> KServeRequest:
    if len(body) > THREAD_DECODE_BYTES:
        return await asyncio.to_thread(decode_request, body, header_length)
    return decode_request(body, header_length)


def _validate(parsed: KServeRequest, target: Target) -> None:
    check_instance(parsed.inputs, target.method.inputs, batch_dim=target.servable.with_batch_dim)
    known = [s.name for s in target.method.outputs]
    for requested in parsed.outputs or ():
        if requested.name not in known:
            raise BadInputError(f"unknown output {requested.name!r}; outputs: {known}")


def _infer_request(parsed: KServeRequest, target: Target, deadline: float) -> InferRequest:
    requested = tuple(o.name for o in parsed.outputs) if parsed.outputs else None
    return InferRequest(
        id=request_id_var.get(),
        servable=target.servable.name,
        version=target.servable.version,
        method=target.method.name,
        instances=(parsed.inputs,),
        outputs=requested,
        deadline=deadline,
    )


def _reply_outputs(reply: InferReply) -> dict[str, Tensor]:
    """The outputs of the single instance, or the reply's error raised."""
    if reply.error is not None:
        raise error_for(reply.error.code, reply.error.message)
    if len(reply.instances) != 1:
        raise InternalError(f"scheduler replied with {len(reply.instances)} instances, expected 1")
    result = reply.instances[0]
    if result.error is not None:
        raise error_for(result.error.code, result.error.message)
    return dict(result.outputs or {})


def _select_outputs(
    outputs: dict[str, Tensor], parsed: KServeRequest, target: Target
) -> list[tuple[str, Tensor, bool]]:
    wanted = parsed.outputs or tuple(
        RequestedOutput(s.name, None) for s in target.method.outputs if s.name in outputs
    )
    selected: list[tuple[str, Tensor, bool]] = []
    for requested in wanted:
        tensor = outputs.get(requested.name)
        if tensor is None:
            raise InternalError(f"the reply lacks output {requested.name!r}")
        binary = parsed.binary_data_output if requested.binary is None else requested.binary
        selected.append((requested.name, tensor, binary))
    return selected

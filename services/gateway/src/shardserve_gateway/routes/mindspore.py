"""MindSpore Serving REST: ``POST /model/<servable>[/version/<n>]:<method>``.

Request and response bodies follow mindspore-serving.md §3 (see ``mindspore_codec``);
version 0 or none means the highest ready version.

**Deviation, on purpose:** MindSpore answers every request with HTTP 200 and puts errors
in the body. We keep its bodies (``{"error_msg": ...}`` for the whole request, or per
instance inside ``"instances"``) but send real statuses: 400 bad input, 404 unknown
servable/version/method, 503 not ready/overloaded, 504 deadline, 500 internal. When
some instances succeed the status is 200 and the failed ones carry ``error_msg``; when
all fail with the same message the body collapses to one ``error_msg`` (as MindSpore
does) and the status is that error's; when all fail differently the status is the
first instance's error's.
"""

from __future__ import annotations

import re
import time
from typing import Any

from aiohttp import web

from shardserve.errors import BadInputError, InternalError, error_for, http_status
from shardserve.process.integers import parse_positive_int
from shardserve.process.lifecycle import request_id_var
from shardserve.repo.signature import check_instance
from shardserve.wire.protocol import ErrorInfo, InferReply, InferRequest, InstanceResult
from shardserve.wire.tensors import Tensor
from shardserve_gateway.codecs.body import read_body
from shardserve_gateway.codecs.mindspore import (
    instance_reply,
    instance_tensors,
    parse_instances,
    reply_body,
)
from shardserve_gateway.dispatch import choose_timeout
from shardserve_gateway.mesh_view import Target, find_method, require_ready
from shardserve_gateway.responses import JSON_TYPE, error_response
from shardserve_gateway.routes.kserve import TIMEOUT_HEADER
from shardserve_gateway.state import (
    DISPATCHER_KEY,
    INFER_LABELS_KEY,
    MESH_VIEW_KEY,
    SETTINGS_KEY,
    UNKNOWN_LABELS,
    refuse_while_draining,
)

_URL = re.compile(r"^(?P<servable>[^/:]*)(?:/version/(?P<version>[^/:]*))?(?::(?P<method>.*))?$")
MAX_VERSION = 2**32 - 1


def add_routes(app: web.Application) -> None:
    """Register the MindSpore REST route."""
    app.router.add_post("/model/{tail:.+}", predict)


def parse_url(tail: str) -> tuple[str, int, str]:
    """``servable[/version/n]:method`` -> (servable, version, method), MindSpore's messages."""
    match = _URL.match(tail)
    if match is None:
        raise BadInputError("please check url, the keyword:[service method] must contain.")
    servable, raw_version, method = match["servable"], match["version"], match["method"]
    if not servable:
        raise BadInputError("please check url, the keyword:[model] must contain.")
    if not method:
        raise BadInputError("please check url, the keyword:[service method] must contain.")
    if raw_version is None:
        return servable, 0, method
    return servable, _url_version(raw_version), method


def _url_version(raw: str) -> int:
    """0 (highest ready) or a version below ``MAX_VERSION``, in MindSpore's words."""
    version = parse_positive_int(raw, zero_allowed=True)
    too_long = version is None and raw.isascii() and raw.isdigit()
    if too_long or (version is not None and version >= MAX_VERSION):
        raise BadInputError(
            f"please check url, version number range failed, request version number {raw}"
        )
    if version is None:
        raise BadInputError(
            f"please check url, the keyword:[version] value invalid, request version number {raw}"
        )
    return version


async def predict(request: web.Request) -> web.Response:
    started = time.time()
    request[INFER_LABELS_KEY] = UNKNOWN_LABELS
    app = request.app
    refuse_while_draining(app)
    servable_name, version, method_name = parse_url(request.match_info["tail"])
    servable = app[MESH_VIEW_KEY].find_servable(servable_name, version)
    target = Target(servable, find_method(servable, method_name))
    request[INFER_LABELS_KEY] = (servable.name, target.method.name)
    require_ready(servable)
    body = await read_body(request, app[SETTINGS_KEY].max_body_bytes)
    instances = _instances(parse_instances(body), target)
    settings = app[SETTINGS_KEY]
    timeout = choose_timeout(
        request.headers.get(TIMEOUT_HEADER),
        None,
        default_s=settings.default_timeout_s,
        max_s=settings.max_timeout_s,
    )
    infer_request = InferRequest(
        id=request_id_var.get(),
        servable=servable.name,
        version=servable.version,
        method=target.method.name,
        instances=tuple(instances),
        deadline=started + timeout,
    )
    reply = await app[DISPATCHER_KEY].call(infer_request)
    return reply_response(reply, target, len(instances))


def _instances(raw: list[dict[str, Any]], target: Target) -> list[dict[str, Tensor]]:
    """Convert and check every instance; the first bad one fails the whole request."""
    specs = target.method.inputs
    converted: list[dict[str, Tensor]] = []
    for index, instance in enumerate(raw):
        try:
            tensors = instance_tensors(instance, specs)
            check_instance(tensors, specs, batch_dim=target.servable.with_batch_dim)
        except BadInputError as exc:
            prefix = f"instance {index}: " if len(raw) > 1 else ""
            raise BadInputError(prefix + exc.message) from None
        converted.append(tensors)
    return converted


def reply_response(reply: InferReply, target: Target, expected: int) -> web.Response:
    """Turn the scheduler's reply into MindSpore's response shape with a real status."""
    if reply.error is not None:
        raise error_for(reply.error.code, reply.error.message)
    if len(reply.instances) != expected:
        raise InternalError(
            f"scheduler replied with {len(reply.instances)} instances, expected {expected}"
        )
    failed = [r for r in reply.instances if r.error is not None]
    if failed and len(failed) == len(reply.instances):
        first = _first_error(failed)
        if len({r.error.message for r in failed if r.error is not None}) == 1:
            return error_response(http_status(first.code), first.message, mindspore=True)
        status = http_status(first.code)
    else:
        status = 200
    body = {"instances": [instance_reply(r, target.method.outputs) for r in reply.instances]}
    return web.Response(body=reply_body(body), status=status, content_type=JSON_TYPE)


def _first_error(failed: list[InstanceResult]) -> ErrorInfo:
    error = failed[0].error
    assert error is not None
    return error

"""One ModelInfer: the REST route's steps (``kserve.infer_target``, ``run_infer``) with
the request decoded from protobuf and the gRPC deadline as its timeout."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from shardserve_gateway.codecs.kserve import KServeRequest
from shardserve_gateway.dispatch import MIN_TIMEOUT_S
from shardserve_gateway.grpcapi.calls import Call
from shardserve_gateway.grpcapi.infer_codec import decode_infer, encode_infer
from shardserve_gateway.grpcapi.protocol import grpc_service_pb2 as pb
from shardserve_gateway.grpcapi.transport.context import CallContext
from shardserve_gateway.mesh_view import require_ready
from shardserve_gateway.routes import kserve


def deadline_timeout(context: CallContext) -> str | None:
    """The call's deadline as an ``X-Request-Timeout`` value (None: the client set none);
    a deadline already passed leaves the shortest timeout, so it answers
    DEADLINE_EXCEEDED rather than a refusal."""
    remaining = context.time_remaining()
    return None if remaining is None else repr(max(remaining, MIN_TIMEOUT_S))


async def _decode(request: pb.ModelInferRequest) -> KServeRequest:
    """Decode big requests off the event loop, as the REST route does."""
    if sum(len(raw) for raw in request.raw_input_contents) > kserve.THREAD_DECODE_BYTES:
        return await asyncio.to_thread(decode_infer, request)
    return decode_infer(request)


async def infer(
    app: web.Application,
    request: pb.ModelInferRequest,
    context: CallContext,
    call: Call,
) -> pb.ModelInferResponse:
    """One ModelInfer: the REST route's steps, with the gRPC deadline as its timeout."""
    started = time.time()
    target = kserve.infer_target(app, request.model_name, request.model_version or None)
    call.labels = (target.servable.name, target.method.name)
    require_ready(target.servable)
    parsed = await _decode(request)
    outputs = await kserve.run_infer(app, parsed, target, deadline_timeout(context), started)
    return encode_infer(
        model_name=request.model_name,
        model_version=str(target.servable.version),
        request_id=parsed.id,
        outputs=outputs,
    )

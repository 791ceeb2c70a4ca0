"""The gateway's gRPC server: grpc.aio on the gateway's own event loop, beside aiohttp.

The service's methods are registered from the .proto's descriptor with the bytes left
undecoded: each is parsed here, so a malformed message is INVALID_ARGUMENT naming the
problem (grpc's own deserializer would answer UNKNOWN and log a traceback), and a large
ModelInferRequest is parsed off the event loop (as REST bodies are decoded). Methods the
servicer lacks are not registered: grpc answers them UNIMPLEMENTED.

Messages are limited to ``--max-body-mb`` as REST bodies are (grpc refuses a larger one
with RESOURCE_EXHAUSTED before any handler runs); responses are not limited, as REST's
are not. With ``--tls-cert``/``--tls-key`` the port speaks TLS with the same pair.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
from aiohttp import web
from google.protobuf.message import DecodeError, Message

from shardserve.errors import BadInputError
from shardserve_gateway.grpcapi.protocol import grpc_service_pb2 as pb
from shardserve_gateway.grpcapi.service import InferenceService
from shardserve_gateway.routes.kserve import THREAD_DECODE_BYTES
from shardserve_gateway.settings import GatewaySettings
from shardserve_gateway.state import SETTINGS_KEY

SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]


async def start_grpc(app: web.Application) -> grpc.aio.Server:
    """Build, bind and start the server on ``--grpc-port`` (OSError if the port is taken)."""
    settings = app[SETTINGS_KEY]
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", settings.max_body_bytes),
            ("grpc.max_send_message_length", -1),
            ("grpc.so_reuseport", 1 if settings.reuse_port else 0),
        ]
    )
    server.add_generic_rpc_handlers((service_handlers(InferenceService(app)),))
    address = f"{settings.host}:{settings.grpc_port}"
    credentials = _credentials(settings)
    if credentials is None:
        bound = server.add_insecure_port(address)
    else:
        bound = server.add_secure_port(address, credentials)
    if bound == 0:
        raise OSError(f"cannot listen for gRPC on {address}")
    await server.start()
    return server


def service_handlers(service: object) -> grpc.GenericRpcHandler:
    """``inference.GRPCInferenceService``'s methods that ``service`` has."""
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for method in SERVICE.methods:
        handler = getattr(service, method.name, None)
        if handler is None:
            continue
        request_type = getattr(pb, method.input_type.name)
        serialize = getattr(pb, method.output_type.name).SerializeToString
        if method.client_streaming:
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(
                _parse_each(handler, request_type), response_serializer=serialize
            )
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                _parse_one(handler, request_type), response_serializer=serialize
            )
    return grpc.method_handlers_generic_handler(SERVICE.full_name, handlers)


def parse(request_type: type[Message], raw: bytes) -> Any:
    """A message from its bytes; BadInputError naming the type when they are not one."""
    try:
        return request_type.FromString(raw)
    except DecodeError as exc:
        raise BadInputError(
            f"the request is not a valid {request_type.DESCRIPTOR.full_name}: {exc}"
        ) from None


def _parse_one(
    handler: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]], request_type: type[Message]
) -> Callable[[bytes, grpc.aio.ServicerContext], Awaitable[Any]]:
    async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            if len(raw) > THREAD_DECODE_BYTES:
                request = await asyncio.to_thread(parse, request_type, raw)
            else:
                request = parse(request_type, raw)
        except BadInputError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, exc.message)
        return await handler(request, context)

    return handle


def _parse_each(
    handler: Callable[[AsyncIterator[Any], grpc.aio.ServicerContext], Awaitable[None]],
    request_type: type[Message],
) -> Callable[[AsyncIterator[bytes], grpc.aio.ServicerContext], Awaitable[None]]:
    async def handle(raws: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
        async def requests() -> AsyncIterator[Any]:
            # A malformed message ends the stream with INVALID_ARGUMENT (raised in the
            # handler's scope, which answers it).
            async for raw in raws:
                yield parse(request_type, raw)

        await handler(requests(), context)

    return handle


def _credentials(settings: GatewaySettings) -> grpc.ServerCredentials | None:
    if settings.tls_cert is None or settings.tls_key is None:
        return None
    pair = (Path(settings.tls_key).read_bytes(), Path(settings.tls_cert).read_bytes())
    return grpc.ssl_server_credentials([pair])

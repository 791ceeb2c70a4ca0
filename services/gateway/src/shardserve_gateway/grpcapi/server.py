"""The gateway's gRPC server: our HTTP/2 (transport/http2) on the gateway's event loop, beside
aiohttp.

Why not grpc.aio: it runs every call as several batches of operations, each a hop from
the event loop to grpc's poller thread and back, so a call cost the gateway about three
times a REST binary request (docs/performance.md, issue 38). Here the socket is read on
the loop, as aiohttp reads it: many calls per read, their answers written together.

The service's methods are routed from the .proto's descriptor with the bytes parsed here,
so a malformed message is INVALID_ARGUMENT naming the problem, and a large
ModelInferRequest is parsed off the event loop (as REST bodies are decoded). Methods the
servicer lacks answer UNIMPLEMENTED.

Messages are limited to ``--max-body-mb`` as REST bodies are (RESOURCE_EXHAUSTED, as grpc
answers); responses are not limited, as REST's are not. With ``--tls-cert``/``--tls-key``
the port speaks TLS (ALPN h2) with the same pair.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web
from google.protobuf.message import DecodeError, Message

from shardserve.errors import BadInputError
from shardserve_gateway.grpcapi.calls import RETRY_LATER
from shardserve_gateway.grpcapi.protocol import grpc_service_pb2 as pb
from shardserve_gateway.grpcapi.service import InferenceService
from shardserve_gateway.grpcapi.transport.connection import CallHandler, CallLimits, GrpcConnection
from shardserve_gateway.grpcapi.transport.context import CallContext
from shardserve_gateway.grpcapi.transport.stream import ServerStream
from shardserve_gateway.grpcapi.transport.wire import StatusCode
from shardserve_gateway.routes.kserve import THREAD_DECODE_BYTES
from shardserve_gateway.settings import GatewaySettings
from shardserve_gateway.state import SETTINGS_KEY
from shardserve_gateway.tls import server_tls

SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
# A closed connection's socket goes once its last answers are written; a client that
# reads nothing more is cut off after this long.
CLOSE_SECONDS = 5.0
SHUTTING_DOWN = (StatusCode.UNAVAILABLE, "the gateway is shutting down; retry", RETRY_LATER)


class GrpcServer:
    """The listening socket and its connections (each owns its calls)."""

    def __init__(self, routes: dict[str, CallHandler], limits: CallLimits) -> None:
        self._routes = routes
        self._limits = limits
        self._connections: set[GrpcConnection] = set()
        self._server: asyncio.Server | None = None

    async def start(self, settings: GatewaySettings) -> None:
        """Listen on ``--grpc-port`` (OSError if the port is taken)."""
        self._server = await asyncio.get_running_loop().create_server(
            self._connection,
            settings.host,
            settings.grpc_port,
            ssl=server_tls(settings, alpn=("h2",)),
            reuse_port=settings.reuse_port or None,
        )

    async def stop(self) -> None:
        """Stop listening, end the calls still open with UNAVAILABLE (the gateway's drain
        has waited for them already), close every connection (GOAWAY), wait for the calls'
        tasks, which closing cancels, and for every socket to be closed."""
        if self._server is not None:
            self._server.close()
        connections = list(self._connections)
        for connection in connections:
            connection.close(SHUTTING_DOWN)
        for connection in connections:
            await connection.wait_calls()
        for connection in connections:
            await connection.wait_closed(CLOSE_SECONDS)
        if self._server is not None:
            await self._server.wait_closed()

    def _connection(self) -> GrpcConnection:
        connection = GrpcConnection(self._routes.get, self._limits, self._connections.discard)
        self._connections.add(connection)
        return connection


async def start_grpc(app: web.Application) -> GrpcServer:
    """Build, bind and start the server on ``--grpc-port`` (OSError if the port is taken)."""
    settings = app[SETTINGS_KEY]
    server = GrpcServer(service_routes(InferenceService(app)), CallLimits(settings.max_body_bytes))
    await server.start(settings)
    return server


def service_routes(service: object) -> dict[str, CallHandler]:
    """``inference.GRPCInferenceService``'s methods that ``service`` has, by path."""
    routes: dict[str, CallHandler] = {}
    for method in SERVICE.methods:
        handler = getattr(service, method.name, None)
        if handler is None:
            continue
        request_type = getattr(pb, method.input_type.name)
        path = f"/{SERVICE.full_name}/{method.name}"
        if method.client_streaming:
            routes[path] = _streaming(handler, request_type)
        else:
            routes[path] = _unary(handler, request_type)
    return routes


def parse(request_type: type[Message], raw: bytes) -> Any:
    """A message from its bytes; BadInputError naming the type when they are not one."""
    try:
        return request_type.FromString(raw)
    except DecodeError as exc:
        raise BadInputError(
            f"the request is not a valid {request_type.DESCRIPTOR.full_name}: {exc}"
        ) from None


def _unary(
    handler: Callable[[Any, CallContext], Awaitable[Message]], request_type: type[Message]
) -> CallHandler:
    async def handle(stream: ServerStream, context: CallContext) -> None:
        raw = await stream.single_message()
        try:
            if len(raw) > THREAD_DECODE_BYTES:
                request = await asyncio.to_thread(parse, request_type, raw)
            else:
                request = parse(request_type, raw)
        except BadInputError as exc:
            await context.abort(StatusCode.INVALID_ARGUMENT, exc.message)
        response = await handler(request, context)
        await stream.send_message(response.SerializeToString())

    return handle


def _streaming(
    handler: Callable[[AsyncIterator[Any], CallContext], Awaitable[None]],
    request_type: type[Message],
) -> CallHandler:
    async def handle(stream: ServerStream, context: CallContext) -> None:
        async def requests() -> AsyncIterator[Any]:
            # A malformed message ends the stream with INVALID_ARGUMENT (raised in the
            # handler's scope, which answers it).
            async for raw in stream.messages():
                yield parse(request_type, raw)

        await handler(requests(), context)

    return handle

"""``inference.GRPCInferenceService``: the KServe v2 gRPC API (with Triton's repository
and streaming methods) over the same functions the REST routes call.

Each method opens the ``CallGuard`` scope (request id, auth, in-flight count, metrics,
status codes) and then does what its REST route does, through the route's own
functions: ``kserve.infer_target`` / ``run_infer`` for ModelInfer, ``kserve.metadata``,
``kserve.require_model_ready``, ``repository.index_entries`` / ``send_command``.
ModelReady answers ``ready: false`` for a model that is unknown or not ready, as Triton
does. Methods the gateway does not serve (ModelConfig, statistics, shared memory, trace
and log settings) are not registered, so grpc answers UNIMPLEMENTED (see ``server``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TypeAlias

from aiohttp import web

import shardserve
from shardserve.errors import NotFoundError, UnavailableError
from shardserve_gateway.grpcapi.calls import CallGuard
from shardserve_gateway.grpcapi.infer import infer
from shardserve_gateway.grpcapi.infer_codec import parameter_values
from shardserve_gateway.grpcapi.protocol import grpc_service_pb2 as pb
from shardserve_gateway.grpcapi.streaming import StreamInfer
from shardserve_gateway.grpcapi.transport.context import CallContext
from shardserve_gateway.routes import kserve, repository

Context: TypeAlias = CallContext


class InferenceService:
    """The servicer; ``app`` is the gateway's aiohttp application (its state)."""

    def __init__(self, app: web.Application) -> None:
        self._app = app
        self._guard = CallGuard(app)
        self._stream = StreamInfer(app, self._guard)

    async def ServerLive(
        self, request: pb.ServerLiveRequest, context: Context
    ) -> pb.ServerLiveResponse:
        async with self._guard.scope(context, health=True):
            return pb.ServerLiveResponse(live=True)

    async def ServerReady(
        self, request: pb.ServerReadyRequest, context: Context
    ) -> pb.ServerReadyResponse:
        async with self._guard.scope(context, health=True):
            return pb.ServerReadyResponse(ready=not kserve.not_ready_reasons(self._app))

    async def ModelReady(
        self, request: pb.ModelReadyRequest, context: Context
    ) -> pb.ModelReadyResponse:
        async with self._guard.scope(context):
            try:
                kserve.require_model_ready(self._app, request.name, request.version or None)
            except (NotFoundError, UnavailableError):
                return pb.ModelReadyResponse(ready=False)
            return pb.ModelReadyResponse(ready=True)

    async def ServerMetadata(
        self, request: pb.ServerMetadataRequest, context: Context
    ) -> pb.ServerMetadataResponse:
        async with self._guard.scope(context):
            return pb.ServerMetadataResponse(
                name=kserve.SERVER_NAME,
                version=shardserve.__version__,
                extensions=kserve.EXTENSIONS,
            )

    async def ModelMetadata(
        self, request: pb.ModelMetadataRequest, context: Context
    ) -> pb.ModelMetadataResponse:
        async with self._guard.scope(context):
            document = kserve.metadata(self._app, request.name, request.version or None)
            return pb.ModelMetadataResponse(**document)

    async def ModelInfer(
        self, request: pb.ModelInferRequest, context: Context
    ) -> pb.ModelInferResponse:
        async with self._guard.scope(context) as call:
            return await infer(self._app, request, context, call)

    async def ModelStreamInfer(
        self, requests: AsyncIterator[pb.ModelInferRequest], context: Context
    ) -> None:
        # A coroutine, not a generator: responses go out with context.write, so the
        # requests of one stream are answered concurrently.
        async with self._guard.scope(context) as call:
            await self._stream.run(requests, context, call)

    async def RepositoryIndex(
        self, request: pb.RepositoryIndexRequest, context: Context
    ) -> pb.RepositoryIndexResponse:
        async with self._guard.scope(context):
            entries = repository.index_entries(self._app, ready_only=request.ready)
            return pb.RepositoryIndexResponse(models=entries)

    async def RepositoryModelLoad(
        self, request: pb.RepositoryModelLoadRequest, context: Context
    ) -> pb.RepositoryModelLoadResponse:
        async with self._guard.scope(context):
            body = {"parameters": parameter_values(request.parameters)}
            await repository.send_command(self._app, "load", request.model_name, body)
            return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest, context: Context
    ) -> pb.RepositoryModelUnloadResponse:
        async with self._guard.scope(context):
            body = {"parameters": parameter_values(request.parameters)}
            await repository.send_command(self._app, "unload", request.model_name, body)
            return pb.RepositoryModelUnloadResponse()

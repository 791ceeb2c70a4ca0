"""The gateway's own HTTP-side cost: the real gateway app with the broker replaced by an
in-process answer, beside a bare aiohttp handler, for the demo MatMul's bodies.

    python -m benchmarks.gateway_alone --variant gateway|bare --port 8501

``gateway``: ``shardserve_gateway.app.create_app`` with its middlewares, routes, decoding,
validation and encoding, and a dispatcher that answers every InferRequest at once with a
precomputed output (no broker, no model), so its CPU per request is what the gateway
spends on one request outside the message side. ``bare``: an aiohttp handler that reads
the body and returns a response of the same size. Both run as the gateway does (uvloop,
no access log, no automatic decompression, the same C heap tuning). The ``gateway-alone``
scenario loads both with the benchmarks' client and records their CPU per request.

Routes: ``GET /v2/health/ready``, ``POST /v2/models/matmul/infer``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import numpy as np
from aiohttp import web

from benchmarks import floor_server
from shardserve.process.eventloop import configured_loop_factory
from shardserve.process.heap import keep_freed_memory
from shardserve.wire.protocol import (
    InferReply,
    InferRequest,
    InstanceResult,
    MeshStatus,
    MethodStatus,
    RepositoryCommand,
    ServableStatus,
    TensorSpec,
)
from shardserve.wire.tensors import Tensor
from shardserve_gateway.app import create_app as create_gateway_app
from shardserve_gateway.mesh_view import MeshView
from shardserve_gateway.settings import GatewaySettings

# The demo MatMul's output shape; the values do not matter here (every input gets it).
ANSWER = Tensor.from_numpy(np.full((128, 16), -48.0, np.float32))
VARIANTS = ("gateway", "bare")


class AnsweringDispatcher:
    """Answers every request at once with ``ANSWER`` for each instance."""

    available = True

    async def call(self, request: InferRequest) -> InferReply:
        return InferReply.model_construct(
            id=request.id,
            servable=request.servable,
            version=request.version,
            method=request.method,
            instances=tuple(InstanceResult(outputs={"y": ANSWER}) for _ in request.instances),
            error=None,
        )

    async def command(self, command: RepositoryCommand) -> None:
        raise NotImplementedError("no model repository behind this gateway")


def matmul_status() -> MeshStatus:
    """A mesh status with the demo MatMul (version 1, ready), as the scheduler sends it."""
    method = MethodStatus(
        name="predict",
        inputs=(TensorSpec(name="x", datatype="FP32", shape=(128, 96)),),
        outputs=(TensorSpec(name="y", datatype="FP32", shape=(128, 16)),),
    )
    servable = ServableStatus(
        name="matmul", version=1, ready=True, rank_size=1, stage_size=1,
        methods=(method,), ranks=(),
    )  # fmt: skip
    return MeshStatus(scheduler="gateway-alone", time=0.0, servables=(servable,))


def gateway_app() -> web.Application:
    settings = GatewaySettings(gateway_id="gateway-alone")
    view = MeshView(settings.status_stale_s, clock=lambda: 0.0)  # the status never ages
    view.update(matmul_status())
    return create_gateway_app(settings, dispatcher=AnsweringDispatcher(), mesh_view=view)


def bare_app() -> web.Application:
    answer = b"\0" * (len(ANSWER.data) + 160)  # about the gateway's binary response

    async def infer(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=answer, content_type="application/octet-stream")

    app = web.Application(client_max_size=256 * 1024 * 1024)
    app.router.add_get("/v2/health/ready", floor_server.ready)
    app.router.add_post("/v2/models/matmul/infer", infer)
    return app


def create_app(variant: str) -> web.Application:
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; one of {', '.join(VARIANTS)}")
    return gateway_app() if variant == "gateway" else bare_app()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gateway_alone")
    parser.add_argument("--variant", choices=VARIANTS, default="gateway")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8501)
    args = parser.parse_args(argv)
    keep_freed_memory()
    loop = (configured_loop_factory() or asyncio.new_event_loop)()
    app = create_app(args.variant)
    # As the gateway's runner: no access log, bodies not decompressed.
    web.run_app(
        app, host=args.host, port=args.port, print=None, loop=loop,
        access_log=None, auto_decompress=False,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

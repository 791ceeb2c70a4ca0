"""Fakes for gateway unit tests: the real app with a fake dispatcher and a manual clock.

The HTTP <-> protocol mapping is pure logic, so these tests run the real aiohttp app
(aiohttp's TestServer/TestClient; pytest-aiohttp is not installed) and replace only the
message side with an in-process dispatcher that records what would be published.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from aiohttp.test_utils import TestClient

from shardserve.wire.protocol import (
    InferReply,
    InferRequest,
    InstanceResult,
    MeshStatus,
    MethodStatus,
    RankStatus,
    RepositoryCommand,
    ServableStatus,
    TensorSpec,
)
from shardserve.wire.tensors import Tensor
from shardserve_gateway.codecs.json_tensors import to_tensor
from shardserve_gateway.mesh_view import MeshView

WEIGHT = np.full((96, 16), 0.5, dtype=np.float32)


class ManualClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


Handler = Callable[[InferRequest], Awaitable[InferReply] | InferReply]


def ok_reply(request: InferRequest, outputs: list[dict[str, Tensor]]) -> InferReply:
    return InferReply(
        id=request.id,
        servable=request.servable,
        version=request.version,
        method=request.method,
        instances=tuple(InstanceResult(outputs=o) for o in outputs),
    )


def model_reply(request: InferRequest) -> InferReply:
    """What the demo servables compute: matmul (-(x @ 0.5)), softmax of it, and echo."""
    outputs = []
    for instance in request.instances:
        if request.servable == "echo":
            outputs.append({"y": instance["x"]})
            continue
        y = -(instance["x"].to_numpy() @ WEIGHT)
        if request.method == "predict_softmax":
            e = np.exp(y - y.max(axis=-1, keepdims=True))
            outputs.append({"p": Tensor.from_numpy(e / e.sum(axis=-1, keepdims=True))})
        else:
            outputs.append({"y": Tensor.from_numpy(y), "s": to_tensor(np.asarray(y.sum()))})
    return ok_reply(request, outputs)


@dataclass
class FakeDispatcher:
    """Records every request that would be published and answers with ``handler``."""

    handler: Handler = model_reply
    available: bool = True
    requests: list[InferRequest] = field(default_factory=list)
    commands: list[RepositoryCommand] = field(default_factory=list)

    async def command(self, command: RepositoryCommand) -> None:
        self.commands.append(command)

    async def call(self, request: InferRequest) -> InferReply:
        self.requests.append(request)
        result = self.handler(request)
        if isinstance(result, InferReply):
            return result
        return await result


def spec(name: str, datatype: str, shape: tuple[int, ...]) -> TensorSpec:
    return TensorSpec(name=name, datatype=datatype, shape=shape)


def servable(
    name: str,
    version: int,
    methods: tuple[MethodStatus, ...],
    *,
    ready: bool = True,
    reason: str = "",
    with_batch_dim: bool = False,
    ranks: tuple[RankStatus, ...] = (),
    **fields: Any,
) -> ServableStatus:
    return ServableStatus(
        name=name,
        version=version,
        ready=ready,
        reason=reason,
        rank_size=2,
        stage_size=1,
        with_batch_dim=with_batch_dim,
        methods=methods,
        ranks=ranks,
        **fields,
    )


MATMUL_METHODS = (
    MethodStatus(
        name="predict",
        inputs=(spec("x", "FP32", (128, 96)),),
        outputs=(spec("y", "FP32", (128, 16)), spec("s", "FP32", ())),
    ),
    MethodStatus(
        name="predict_softmax",
        inputs=(spec("x", "FP32", (128, 96)),),
        outputs=(spec("p", "FP32", (128, 16)),),
    ),
)


def echo_servable(datatype: str, shape: tuple[int, ...] = (-1,)) -> ServableStatus:
    method = MethodStatus(
        name="predict", inputs=(spec("x", datatype, shape),), outputs=(spec("y", datatype, shape),)
    )
    return servable("echo", 1, (method,))


def mesh_status(*servables: ServableStatus) -> MeshStatus:
    if not servables:
        servables = (
            servable("matmul", 1, MATMUL_METHODS),
            servable("matmul", 2, MATMUL_METHODS),
        )
    return MeshStatus(scheduler="test-scheduler", time=0.0, servables=servables)


@dataclass
class Gateway:
    """One running test app."""

    client: TestClient[Any, Any]
    dispatcher: FakeDispatcher
    view: MeshView
    clock: ManualClock


MakeGateway = Callable[..., Awaitable[Gateway]]

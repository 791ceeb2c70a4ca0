"""Closed-loop gRPC load: ModelInfer calls with one fixed, pre-serialized request.

The request is serialized once and sent as bytes (responses are not parsed, only their
status checked), as the HTTP load sends one fixed body: both measure the server. Workers
share ``channels`` HTTP/2 connections (one each by default, as the HTTP load's pool has
one connection per worker).
"""

from __future__ import annotations

import grpc
import numpy as np

from benchmarks.loadgen import LoadResult, LoadSpec, run_load
from shardserve_gateway.grpcapi.protocol import grpc_service_pb2 as pb

MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"


def infer_request(model: str, inputs: dict[str, np.ndarray]) -> bytes:
    """A ModelInferRequest with every input in ``raw_input_contents`` (tritonclient's way)."""
    request = pb.ModelInferRequest(model_name=model)
    for name, array in inputs.items():
        request.inputs.add(name=name, datatype="FP32", shape=array.shape)
        request.raw_input_contents.append(np.ascontiguousarray(array, np.float32).tobytes())
    return request.SerializeToString()


async def load_grpc(
    address: str, request: bytes, spec: LoadSpec, channels: int | None = None
) -> LoadResult:
    """Drive ModelInfer at ``address`` from ``spec.concurrency`` workers."""
    count = channels or spec.concurrency
    # A local subchannel pool each: grpc otherwise shares one connection among all the
    # channels to one address (measured: 32 workers on one HTTP/2 connection, one gateway
    # process, requests trickling in one by one, 0.2-0.4x the REST figure).
    options = [("grpc.use_local_subchannel_pool", 1)]
    opened = [grpc.aio.insecure_channel(address, options=options) for _ in range(count)]
    calls = [channel.unary_unary(MODEL_INFER) for channel in opened]
    turn = 0

    async def call() -> bool:
        nonlocal turn
        turn = (turn + 1) % count
        await calls[turn](request, timeout=60.0)
        return True

    try:
        return await run_load(call, spec)
    finally:
        for channel in reversed(opened):
            await channel.close()

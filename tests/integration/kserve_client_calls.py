"""KServe's Python client (``kserve.InferenceGRPCClient``, unchanged) against a gateway's
gRPC port; prints what it got as one JSON document.

Run as a process of its own (``python kserve_client_calls.py HOST:PORT TOKEN SEED``):
KServe's generated ``grpc_predict_v2_pb2`` and Triton's (tritonclient's, the gateway's)
define the same ``inference.*`` names in protobuf's default pool, so one process can
import only one of them; a KServe user's process has only KServe's.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable
from typing import Any

import grpc
import numpy as np
from kserve import InferenceGRPCClient, InferInput, InferRequest
from kserve.protocol.grpc import grpc_predict_v2_pb2 as pb
from kserve.protocol.grpc import grpc_predict_v2_pb2_grpc as pb_grpc

SHAPE = (128, 96)


def request(x: np.ndarray, *, binary: bool = True, model: str = "matmul") -> InferRequest:
    data = x if binary else x.reshape(-1).tolist()  # (a list travels as fp32_contents)
    return InferRequest(model, [InferInput("x", list(x.shape), "FP32", data)], request_id="k-1")


def output(response: Any) -> dict[str, Any]:
    (tensor,) = response.outputs
    y = tensor.as_numpy()
    return {
        "id": response.id,
        "model_name": response.model_name,
        "name": tensor.name,
        "shape": list(y.shape),
        "dtype": str(y.dtype),
        "values": y.reshape(-1).tolist(),
    }


async def status_of(call: Awaitable[Any]) -> dict[str, str]:
    try:
        await call
    except grpc.aio.AioRpcError as error:
        return {"code": error.code().name, "details": error.details() or ""}
    return {"code": "OK", "details": ""}


async def metadata(address: str, headers: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    """ModelMetadata through KServe's own generated stub (its client has no method)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        answer = await stub.ModelMetadata(pb.ModelMetadataRequest(name="matmul"), metadata=headers)
    return {
        "name": answer.name,
        "platform": answer.platform,
        "inputs": [[t.name, t.datatype, list(t.shape)] for t in answer.inputs],
        "outputs": [[t.name, t.datatype, list(t.shape)] for t in answer.outputs],
    }


async def calls(address: str, token: str, seed: int) -> dict[str, Any]:
    headers = (("authorization", f"Bearer {token}"),)
    ones = np.ones(SHAPE, np.float32)
    random = np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float32)
    async with InferenceGRPCClient(address, timeout=120) as client:
        return {
            "live": await client.is_server_live(headers=headers),
            "ready": await client.is_server_ready(headers=headers),
            "model_ready": await client.is_model_ready("matmul", headers=headers),
            "unknown_model_ready": await client.is_model_ready("nope", headers=headers),
            "metadata": await metadata(address, headers),
            "raw": output(await client.infer(request(ones), headers=headers)),
            "contents": output(await client.infer(request(ones, binary=False), headers=headers)),
            "random": output(await client.infer(request(random), headers=headers)),
            "errors": {
                "unknown-model": await status_of(
                    client.infer(request(ones, model="nope"), headers=headers)
                ),
                "wrong-shape": await status_of(
                    client.infer(request(ones[:, :95]), headers=headers)
                ),
                "no-token": await status_of(client.infer(request(ones), headers=())),
            },
        }


def main() -> None:
    address, token, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    print(json.dumps(asyncio.run(calls(address, token, seed))))


if __name__ == "__main__":
    main()

"""The load generator's lean gRPC client against grpc's own server (grpc.aio): unary calls
whose messages span several DATA frames, a failed status, connection reuse, a server that
goes away, and the load loop over it."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.grpc_h2_client import GrpcCallError, GrpcH2Client, literal_headers  # noqa: E402
from benchmarks.loadgen import LoadSpec, run_load  # noqa: E402

ECHO, FAIL = "/t.T/Echo", "/t.T/Fail"


class Service:
    """Echo (the bytes reversed) and Fail (NOT_FOUND), counting the peers it saw."""

    def __init__(self) -> None:
        self.peers: set[str] = set()

    async def echo(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        self.peers.add(context.peer())
        return request[::-1]

    async def fail(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await context.abort(grpc.StatusCode.NOT_FOUND, "no such model")
        raise AssertionError("abort returned")

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            "t.T",
            {
                "Echo": grpc.unary_unary_rpc_method_handler(self.echo),
                "Fail": grpc.unary_unary_rpc_method_handler(self.fail),
            },
        )


@pytest.fixture
async def served() -> AsyncIterator[tuple[Service, str, grpc.aio.Server]]:
    service = Service()
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((service.handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield service, f"127.0.0.1:{port}", server
    finally:
        await server.stop(grace=None)


async def test_unary_calls_over_several_frames_reuse_one_connection(served: tuple) -> None:
    service, address, _ = served
    message = bytes(range(256)) * 200  # 51,200 bytes: four DATA frames of 16 KiB at most
    client = GrpcH2Client(address, ECHO, message)
    try:
        for _ in range(20):
            await client.unary()
    finally:
        await client.close()
    assert len(service.peers) == 1  # one caller at a time: one connection, reused


async def test_a_failed_status_is_an_error_naming_it(served: tuple) -> None:
    _, address, _ = served
    client = GrpcH2Client(address, FAIL, b"x")
    try:
        with pytest.raises(GrpcCallError, match="b'5'.*no such model"):
            await client.unary()
    finally:
        await client.close()


async def test_a_server_that_goes_away_fails_the_call(served: tuple) -> None:
    _, address, server = served
    client = GrpcH2Client(address, ECHO, b"x")
    try:
        await client.unary()
        await server.stop(grace=None)
        with pytest.raises((GrpcCallError, ConnectionError, OSError)):
            await client.unary()
    finally:
        await client.close()


async def test_the_load_loop_counts_every_call(served: tuple) -> None:
    _, address, _ = served
    client = GrpcH2Client(address, ECHO, b"payload" * 100)
    spec = LoadSpec(concurrency=4, duration_s=60.0, warmup_s=0.0, max_requests=40)
    try:
        result = await run_load(client.call(), spec)
    finally:
        await client.close()
    assert result.errors == 0
    assert result.calls_total >= 40


def test_header_blocks_are_stateless_literals() -> None:
    block = literal_headers([(":method", "POST"), ("te", "trailers")])
    assert block == b"\x00\x07:method\x04POST" + b"\x00\x02te\x08trailers"
    with pytest.raises(ValueError, match="too long"):
        literal_headers([("x", "y" * 127)])

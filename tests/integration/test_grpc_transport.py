"""The gateway's gRPC transport (h2 on the event loop) against grpc's own client, over
real sockets: what the service tests (test_grpc*.py) do not reach on the demo mesh:
16 MiB messages both ways (flow control), compressed requests, TLS with ALPN, binary
metadata, deadlines and client cancels reaching the handler, long streams in order,
requests that are not gRPC, and a server stop with calls open.

The server runs in the test's event loop with handlers of the test's own (no mesh)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import grpc
import h2.config
import h2.connection
import h2.events
import pytest

from shardserve.ops.child_mesh import free_port
from shardserve_gateway.grpcapi.server import GrpcServer
from shardserve_gateway.grpcapi.transport.connection import CallHandler, CallLimits
from shardserve_gateway.grpcapi.transport.context import CallContext
from shardserve_gateway.grpcapi.transport.stream import ServerStream
from shardserve_gateway.grpcapi.transport.wire import StatusCode

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 32 * 1024 * 1024
BIG = 16 * 1024 * 1024


class Handlers:
    """The test service: echo, sized answers, a call that waits forever, a stream."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()
        self.entered = asyncio.Event()

    def routes(self) -> dict[str, CallHandler]:
        return {
            "/t.T/Echo": self.echo,
            "/t.T/Sized": self.sized,
            "/t.T/Hang": self.hang,
            "/t.T/Abort": self.abort,
            "/t.T/Count": self.count,
        }

    async def echo(self, stream: ServerStream, context: CallContext) -> None:
        message = await stream.single_message()
        context.set_trailing_metadata(context.invocation_metadata())
        await stream.send_message(message[::-1])

    async def sized(self, stream: ServerStream, context: CallContext) -> None:
        size = int(await stream.single_message())
        await stream.send_message(bytes(range(256)) * (size // 256))

    async def hang(self, stream: ServerStream, context: CallContext) -> None:
        await stream.single_message()
        self.entered.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def abort(self, stream: ServerStream, context: CallContext) -> None:
        await stream.single_message()
        await context.abort(StatusCode.NOT_FOUND, "no such thing", (("retry-after", "1"),))

    async def count(self, stream: ServerStream, context: CallContext) -> None:
        async for message in stream.messages():
            await stream.send_message(message + b"!")


def settings(port: int, certs: Path | None = None) -> SimpleNamespace:
    return SimpleNamespace(
        host="127.0.0.1",
        grpc_port=port,
        reuse_port=False,
        tls_cert=None if certs is None else str(certs / "server.pem"),
        tls_key=None if certs is None else str(certs / "server.key"),
    )


@pytest.fixture
async def served() -> AsyncIterator[tuple[Handlers, GrpcServer, str]]:
    handlers = Handlers()
    server = GrpcServer(handlers.routes(), CallLimits(LIMIT))
    port = free_port()
    await server.start(settings(port))  # type: ignore[arg-type]
    try:
        yield handlers, server, f"127.0.0.1:{port}"
    finally:
        await server.stop()


def channel(address: str) -> grpc.aio.Channel:
    options = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
    return grpc.aio.insecure_channel(address, options=options)


async def test_echo_with_text_and_binary_metadata_round_trip(served: tuple) -> None:
    _, _, address = served
    async with channel(address) as ch:
        call = ch.unary_unary("/t.T/Echo")(
            b"hello", metadata=(("x-tag", "a b"), ("trace-bin", b"\x00\xff\x01")), timeout=10
        )
        assert await call == b"olleh"
        trailing = dict(await call.trailing_metadata())
        assert trailing["x-tag"] == "a b"
        assert trailing["trace-bin"] == b"\x00\xff\x01"


async def test_sixteen_mib_each_way_within_flow_control(served: tuple) -> None:
    _, _, address = served
    async with channel(address) as ch:
        payload = bytes(range(256)) * (BIG // 256)
        assert await ch.unary_unary("/t.T/Echo")(payload, timeout=60) == payload[::-1]
        answer = await ch.unary_unary("/t.T/Sized")(str(BIG).encode(), timeout=60)
        assert answer == payload


async def test_a_gzip_compressed_request_is_inflated(served: tuple) -> None:
    _, _, address = served
    async with channel(address) as ch:
        call = ch.unary_unary("/t.T/Echo")(b"abc" * 1000, compression=grpc.Compression.Gzip)
        assert await call == (b"abc" * 1000)[::-1]


async def test_over_the_limit_is_resource_exhausted_and_the_connection_goes_on(
    served: tuple,
) -> None:
    _, _, address = served
    async with channel(address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await ch.unary_unary("/t.T/Echo")(b"x" * (LIMIT + 1), timeout=60)
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert await ch.unary_unary("/t.T/Echo")(b"ok", timeout=10) == b"ko"


async def test_the_deadline_cancels_the_handler(served: tuple) -> None:
    handlers, _, address = served
    async with channel(address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await ch.unary_unary("/t.T/Hang")(b"", timeout=0.5)
        assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await asyncio.wait_for(handlers.cancelled.wait(), 10)


async def test_a_client_cancel_reaches_the_handler(served: tuple) -> None:
    handlers, _, address = served
    async with channel(address) as ch:
        call = ch.unary_unary("/t.T/Hang")(b"", timeout=60)
        await asyncio.wait_for(handlers.entered.wait(), 10)
        call.cancel()
        await asyncio.wait_for(handlers.cancelled.wait(), 10)


async def test_abort_sends_its_status_details_and_metadata(served: tuple) -> None:
    _, _, address = served
    async with channel(address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await ch.unary_unary("/t.T/Abort")(b"", timeout=10)
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND
    assert raised.value.details() == "no such thing"
    assert ("retry-after", "1") in tuple(raised.value.trailing_metadata())


async def test_a_long_stream_is_answered_in_order(served: tuple) -> None:
    _, _, address = served
    sent = [str(i).encode() * 100 for i in range(1000)]

    async def requests() -> AsyncIterator[bytes]:
        for message in sent:
            yield message

    async with channel(address) as ch:
        call = ch.stream_stream("/t.T/Count")(requests(), timeout=60)
        assert [answer async for answer in call] == [m + b"!" for m in sent]
        assert await call.code() == grpc.StatusCode.OK


async def test_unknown_methods_and_a_unary_call_without_a_message(served: tuple) -> None:
    _, _, address = served
    async with channel(address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await ch.unary_unary("/t.T/Nope")(b"", timeout=10)
        assert raised.value.code() == grpc.StatusCode.UNIMPLEMENTED

        async def nothing() -> AsyncIterator[bytes]:
            return
            yield b""

        call = ch.stream_unary("/t.T/Echo")(nothing(), timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await call
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "exactly one request message" in (raised.value.details() or "")


async def raw_h2(address: str, headers: list[tuple[str, str]]) -> dict[bytes, bytes]:
    """One request by h2's client; the answer's headers."""
    host, _, port = address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    conn.send_headers(1, headers, end_stream=True)
    writer.write(conn.data_to_send())
    try:
        while True:
            data = await asyncio.wait_for(reader.read(65536), 10)
            assert data, "the server closed the connection without answering"
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived):
                    return dict(event.headers)
            writer.write(conn.data_to_send())
    finally:
        writer.close()  # and closed before the test's loop ends (else: unclosed later)
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def test_requests_that_are_not_grpc_get_http_statuses(served: tuple) -> None:
    _, _, address = served
    base = [(":scheme", "http"), (":authority", address), (":path", "/t.T/Echo")]
    get = await raw_h2(address, [(":method", "GET"), *base])
    assert get[b":status"] == b"405"
    plain = await raw_h2(address, [(":method", "POST"), *base, ("content-type", "text/plain")])
    assert plain[b":status"] == b"415"
    bad_timeout = [(":method", "POST"), *base, ("content-type", "application/grpc")]
    answer = await raw_h2(address, [*bad_timeout, ("grpc-timeout", "soon")])
    assert answer[b"grpc-status"] == str(int(StatusCode.INVALID_ARGUMENT)).encode()


async def test_stopping_the_server_ends_open_calls_unavailable(served: tuple) -> None:
    handlers, server, address = served
    async with channel(address) as ch:
        call = ch.unary_unary("/t.T/Hang")(b"", timeout=60)
        await asyncio.wait_for(handlers.entered.wait(), 10)
        await server.stop()
        await asyncio.wait_for(handlers.cancelled.wait(), 10)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await call
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in (raised.value.details() or "")
        assert ("retry-after", "1") in tuple(raised.value.trailing_metadata() or ())


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    subprocess.run([str(ROOT / "scripts" / "make-test-certs"), str(tmp_path)], check=True)
    return tmp_path


async def test_tls_with_alpn(certs: Path) -> None:
    tmp_path = certs
    handlers = Handlers()
    server = GrpcServer(handlers.routes(), CallLimits(LIMIT))
    port = free_port()
    await server.start(settings(port, tmp_path))  # type: ignore[arg-type]
    try:
        credentials = grpc.ssl_channel_credentials((tmp_path / "ca.pem").read_bytes())
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) as ch:
            assert await ch.unary_unary("/t.T/Echo")(b"secret", timeout=10) == b"terces"
    finally:
        await server.stop()

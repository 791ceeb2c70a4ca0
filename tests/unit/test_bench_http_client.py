"""The load generator's lean HTTP client against a real aiohttp server: bodies by
Content-Length and chunked, errors, servers that close, connection reuse."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.http_client import HttpError, PostClient, prepared_post  # noqa: E402
from benchmarks.loadgen import LoadSpec, load_http  # noqa: E402


def echo_app() -> web.Application:
    """/echo answers the body reversed; the others: chunked, closing, refusing."""
    app = web.Application()

    async def echo(request: web.Request) -> web.Response:
        return web.Response(body=(await request.read())[::-1])

    async def chunked(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        for part in (b"ab", b"", b"cde" * 1000):
            if part:
                await response.write(part)
        await response.write_eof()
        return response

    async def closing(request: web.Request) -> web.Response:
        return web.Response(body=b"bye", headers={"Connection": "close"})

    async def refused(request: web.Request) -> web.Response:
        return web.Response(status=503, text="overloaded: try later")

    app.router.add_post("/echo", echo)
    app.router.add_post("/chunked", chunked)
    app.router.add_post("/closing", closing)
    app.router.add_post("/refused", refused)
    return app


@pytest.fixture
async def server() -> AsyncIterator[TestServer]:
    async with TestServer(echo_app()) as running:
        yield running


def url(server: TestServer, path: str) -> str:
    return str(server.make_url(path))


async def test_a_keep_alive_connection_carries_request_after_request(server: TestServer) -> None:
    client = PostClient(url(server, "/echo"), b"hello", {"Content-Type": "text/plain"})
    try:
        assert [await client.post() for _ in range(3)] == [b"olleh"] * 3
        assert client.open_connections == 1  # one connection, reused
    finally:
        await client.close()


async def test_chunked_bodies_and_closing_servers(server: TestServer) -> None:
    chunked = PostClient(url(server, "/chunked"), b"", {})
    closing = PostClient(url(server, "/closing"), b"x", {})
    try:
        assert await chunked.post() == b"ab" + b"cde" * 1000
        assert await closing.post() == b"bye"
        assert closing.open_connections == 0  # the server said close: dropped, not reused
        assert await closing.post() == b"bye"  # a new connection
    finally:
        await chunked.close()
        await closing.close()


async def test_a_status_other_than_200_is_an_error_naming_it(server: TestServer) -> None:
    client = PostClient(url(server, "/refused"), b"x", {})
    try:
        with pytest.raises(HttpError, match="HTTP 503: b'overloaded: try later'"):
            await client.post()
    finally:
        await client.close()


async def test_load_counts_answers_and_errors(server: TestServer) -> None:
    ok = await load_http(url(server, "/echo"), b"abc", {}, LoadSpec(4, 0.3, 0.05))
    assert ok.errors == 0 and ok.requests > 0
    bad = await load_http(url(server, "/refused"), b"abc", {}, LoadSpec(2, 0.2, 0.0))
    assert bad.requests == 0 and bad.errors > 0
    assert bad.first_error.startswith("HttpError: HTTP 503")


def test_the_request_is_prepared_once_with_its_length() -> None:
    host, port, request = prepared_post("http://h:81/v2/x?a=1", b"body", {"X-A": "1"})
    assert (host, port) == ("h", 81)
    assert request == (
        b"POST /v2/x?a=1 HTTP/1.1\r\nHost: h:81\r\nX-A: 1\r\nContent-Length: 4\r\n\r\nbody"
    )
    with pytest.raises(ValueError, match="only plain http://"):
        prepared_post("https://h/x", b"", {})

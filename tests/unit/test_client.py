"""The client against a small in-process KServe v2 server (binary tensor extension)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import socket
import struct
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from shardserve.client import AsyncClient, Client, ClientError, TransportError
from shardserve.client.errors import error_from_http
from shardserve.client.kserve import decode_response, encode_request
from shardserve.client.values import as_instance
from shardserve.errors import (
    BadInputError,
    DeadlineError,
    ErrorCode,
    InferenceError,
    InternalError,
    NotFoundError,
    OverloadedError,
    UnavailableError,
)
from shardserve.wire.tensors import DATATYPE_TO_DTYPE, pack_bytes_elements, unpack_bytes_elements

# ---------------------------------------------------------------- a fake gateway


@dataclass
class Seen:
    """What the fake gateway received."""

    paths: list[str] = field(default_factory=list)
    methods: list[str] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)
    headers: list[Any] = field(default_factory=list)  # case-insensitive header maps
    peers: set[Any] = field(default_factory=set)
    inflight: int = 0
    both_in_flight: asyncio.Event = field(default_factory=asyncio.Event)
    first_request: asyncio.Event = field(default_factory=asyncio.Event)


def parse_request(body: bytes, header_length: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Server side of the binary extension: the JSON header and the decoded inputs."""
    head = json.loads(body[: int(header_length)])
    offset = int(header_length)
    tensors: dict[str, Any] = {}
    for item in head["inputs"]:
        size = item["parameters"]["binary_data_size"]
        raw = body[offset : offset + size]
        offset += size
        shape = tuple(item["shape"])
        if item["datatype"] == "BYTES":
            tensors[item["name"]] = unpack_bytes_elements(raw, shape)
        else:
            dtype = np.dtype(DATATYPE_TO_DTYPE[item["datatype"]])
            tensors[item["name"]] = np.frombuffer(raw, dtype).reshape(shape)
    assert offset == len(body), "request has bytes after its last input"
    return head, tensors


def binary_response(model: str, outputs: dict[str, np.ndarray]) -> web.Response:
    entries, blobs = [], []
    for name, array in outputs.items():
        if array.dtype == np.object_:
            blob, datatype = pack_bytes_elements(array), "BYTES"
        else:
            blob = np.ascontiguousarray(array).tobytes()
            datatype = {v: k for k, v in DATATYPE_TO_DTYPE.items()}[array.dtype.str]
        entries.append(
            {
                "name": name,
                "shape": list(array.shape),
                "datatype": datatype,
                "parameters": {"binary_data_size": len(blob)},
            }
        )
        blobs.append(blob)
    head = json.dumps({"model_name": model, "outputs": entries}).encode()
    return web.Response(
        body=head + b"".join(blobs),
        headers={"Inference-Header-Content-Length": str(len(head))},
        content_type="application/octet-stream",
    )


def make_app(seen: Seen) -> web.Application:
    async def infer(request: web.Request) -> web.Response:
        model, _, method = request.match_info["model"].partition(":")
        seen.methods.append(method)
        body = await request.read()
        seen.paths.append(request.path)
        seen.first_request.set()
        seen.bodies.append(body)
        seen.headers.append(request.headers.copy())
        seen.peers.add(request.transport.get_extra_info("peername") if request.transport else None)
        head, tensors = parse_request(body, request.headers["Inference-Header-Content-Length"])
        return await behave(model, head, tensors, seen)

    app = web.Application()
    app.router.add_post("/v2/models/{model}/infer", infer)
    app.router.add_post("/v2/models/{model}/versions/{version}/infer", infer)
    return app


async def behave(
    model: str, head: dict[str, Any], tensors: dict[str, Any], seen: Seen
) -> web.Response:
    if model == "matmul":
        y = -(tensors["x"] @ np.full((96, 16), 0.5, np.float32))
        return binary_response(model, {"y": y})
    if model == "echo":
        return binary_response(model, tensors)
    if model == "json":
        outputs = [
            {"name": "y", "shape": [2, 2], "datatype": "INT64", "data": [1, 2, 3, 4]},
            {"name": "s", "shape": [2], "datatype": "BYTES", "data": ["a", "bé"]},
        ]
        return web.json_response({"model_name": model, "outputs": outputs})
    if model.startswith("status"):
        status = int(model.removeprefix("status"))
        return web.json_response({"error": f"failed with {status}"}, status=status)
    if model == "pair":  # answers only once two requests are in flight at the same time
        seen.inflight += 1
        if seen.inflight >= 2:
            seen.both_in_flight.set()
        await seen.both_in_flight.wait()
        return binary_response(model, tensors)
    if model == "slow":
        await asyncio.sleep(3600)
    return web.json_response({"error": f"unknown model {model}"}, status=404)


@pytest.fixture
async def gateway() -> AsyncIterator[tuple[str, Seen]]:
    seen = Seen()
    server = TestServer(make_app(seen), host="127.0.0.1")
    await server.start_server()
    try:
        yield f"127.0.0.1:{server.port}", seen
    finally:
        await server.close()


# ---------------------------------------------------------------- wire bytes, pure


def test_request_bytes_follow_the_binary_extension_exactly() -> None:
    inputs = {
        "input0": np.array([[1, 2], [3, 4]], np.uint32),
        "input1": np.array([True, False, True]),
    }
    body, json_length = encode_request(inputs, {"input0": "UINT32", "input1": "BOOL"})
    head = (
        b'{"inputs":['
        b'{"name":"input0","shape":[2,2],"datatype":"UINT32","parameters":{"binary_data_size":16}},'
        b'{"name":"input1","shape":[3],"datatype":"BOOL","parameters":{"binary_data_size":3}}],'
        b'"parameters":{"binary_data_output":true}}'
    )
    data = struct.pack("<4I", 1, 2, 3, 4) + b"\x01\x00\x01"
    assert body == head + data
    assert json_length == len(head)


def test_request_names_id_and_outputs() -> None:
    x = {"x": np.zeros((1,), np.float32)}
    body, length = encode_request(x, {"x": "FP32"}, request_id="r-1", outputs=["y"])
    head = json.loads(body[:length])
    assert "parameters" not in head
    assert head["outputs"] == [{"name": "y", "parameters": {"binary_data": True}}]
    assert head["id"] == "r-1"
    assert body[length:] == b"\0\0\0\0"


def test_bytes_layout_is_the_one_tritonclient_writes() -> None:
    from tritonclient.utils import serialize_byte_tensor

    array = np.array([[b"ab", b""], ["ü".encode(), b"xyz"]], dtype=np.object_)
    body, length = encode_request({"s": array}, {"s": "BYTES"})
    assert body[length:] == serialize_byte_tensor(array).item()


def test_response_with_binary_and_json_outputs_is_parsed() -> None:
    head = json.dumps(
        {
            "model_name": "m",
            "outputs": [
                {
                    "name": "a",
                    "shape": [2],
                    "datatype": "FP16",
                    "parameters": {"binary_data_size": 4},
                },
                {"name": "b", "shape": [1, 2], "datatype": "BOOL", "data": [True, False]},
                {
                    "name": "c",
                    "shape": [1],
                    "datatype": "BYTES",
                    "parameters": {"binary_data_size": 7},
                },
            ],
        }
    ).encode()
    blob = np.array([1.5, -2.0], np.float16).tobytes() + struct.pack("<I", 3) + b"abc"
    out = decode_response(head + blob, str(len(head)))
    np.testing.assert_array_equal(out["a"], np.array([1.5, -2.0], np.float16))
    assert out["a"].dtype == np.float16
    np.testing.assert_array_equal(out["b"], [[True, False]])
    assert out["c"].tolist() == [b"abc"]


@pytest.mark.parametrize(
    ("head", "blob", "header_length", "why"),
    [
        (b"not json", b"", None, "does not parse"),
        (b'{"outputs": 3}', b"", None, "no 'outputs'"),
        (
            b'{"outputs":[{"name":"y","shape":[2],"datatype":"FP32",'
            b'"parameters":{"binary_data_size":8}}]}',
            b"\0" * 4,
            "",
            "claims 8 bytes",
        ),
        (
            b'{"outputs":[{"name":"y","shape":[3],"datatype":"FP32",'
            b'"parameters":{"binary_data_size":8}}]}',
            b"\0" * 8,
            "",
            "8 bytes for shape",
        ),
        (
            b'{"outputs":[{"name":"y","shape":[1],"datatype":"FP32",'
            b'"parameters":{"binary_data_size":4}}]}',
            b"\0" * 6,
            "",
            "2 bytes of binary",
        ),
        (
            b'{"outputs":[{"name":"y","shape":[1],"datatype":"FP99","data":[1]}]}',
            b"",
            None,
            "unknown datatype",
        ),
        (
            b'{"outputs":[{"name":"y","shape":[2],"datatype":"FP32","data":[1]}]}',
            b"",
            None,
            "does not fit",
        ),
        (b'{"outputs":[]}', b"", "999", "outside the body"),
    ],
)
def test_malformed_responses_raise_internal_error(
    head: bytes, blob: bytes, header_length: str | None, why: str
) -> None:
    if header_length == "":
        header_length = str(len(head))
    with pytest.raises(InternalError, match=why):
        decode_response(head + blob, header_length)


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (np.zeros(2, np.complex64), "unsupported dtype"),
        ([[1, 2], [3]], "not a tensor"),
    ],
)
def test_unsupported_values_are_refused_before_sending(value: Any, why: str) -> None:
    with pytest.raises(BadInputError, match=why):
        as_instance({"x": value})


def test_python_values_become_one_element_tensors() -> None:
    converted = as_instance({"b": True, "i": 3, "f": 0.5, "s": "hi", "y": b"\x00"})
    assert {k: (v.dtype.kind, v.shape) for k, v in converted.items()} == {
        "b": ("b", (1,)),
        "i": ("i", (1,)),
        "f": ("f", (1,)),
        "s": ("O", (1,)),
        "y": ("O", (1,)),
    }


# ---------------------------------------------------------------- AsyncClient over HTTP


async def test_matmul_instance_gives_minus_48(gateway: tuple[str, Seen]) -> None:
    address, seen = gateway
    async with AsyncClient(address, "matmul", "predict") as client:
        out = await client.infer({"x": np.ones((128, 96), np.float32)})
    assert out["y"].shape == (128, 16) and out["y"].dtype == np.float32
    assert np.all(out["y"] == -48.0)
    assert seen.paths == ["/v2/models/matmul:predict/infer"]
    assert seen.headers[0]["Content-Type"] == "application/octet-stream"
    assert "Authorization" not in seen.headers[0] and "X-Request-Id" not in seen.headers[0]
    head = json.loads(seen.bodies[0][: int(seen.headers[0]["Inference-Header-Content-Length"])])
    assert head["parameters"] == {"binary_data_output": True}


async def test_version_method_token_and_request_id_reach_the_gateway(
    gateway: tuple[str, Seen],
) -> None:
    address, seen = gateway
    async with AsyncClient(address, "echo", "add_common", 3, token="s3cret") as client:
        await client.infer({"x": np.ones(2, np.int32)}, request_id="req-7")
    assert seen.paths == ["/v2/models/echo:add_common/versions/3/infer"]
    headers = seen.headers[0]
    assert headers["Authorization"] == "Bearer s3cret"
    assert headers["X-Request-Id"] == "req-7"
    head = json.loads(seen.bodies[0][: int(headers["Inference-Header-Content-Length"])])
    assert head["id"] == "req-7" and seen.methods == ["add_common"]


ROUND_TRIPS = [
    np.array([[True, False], [False, True]]),
    np.arange(6, dtype=np.uint8).reshape(2, 3),
    np.array([0, 65535], np.uint16),
    np.array([2**32 - 1], np.uint32),
    np.array([2**64 - 1], np.uint64),
    np.array([-128, 127], np.int8),
    np.array([-(2**15)], np.int16),
    np.array([-(2**31)], np.int32),
    np.array([-(2**63)], np.int64),
    np.array([[0.5, -1.25], [65504.0, 6e-8]], np.float16),
    np.array([1.5, np.inf], np.float32),
    np.array([np.pi], np.float64),
    np.array([1, 2, 3], dtype=">i4"),  # big-endian input goes out little-endian
    np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3)),
    np.array(7.0, np.float32),  # shape []
    np.zeros((0, 4), np.float32),  # empty
]


@pytest.mark.parametrize("array", ROUND_TRIPS, ids=lambda a: f"{a.dtype}{list(a.shape)}")
async def test_every_datatype_round_trips(gateway: tuple[str, Seen], array: np.ndarray) -> None:
    address, _ = gateway
    async with AsyncClient(address, "echo") as client:
        out = (await client.infer({"t": array}))["t"]
    assert out.shape == array.shape
    assert out.dtype == array.dtype.newbyteorder("<")
    np.testing.assert_array_equal(out, array)


async def test_bytes_round_trip_from_str_bytes_and_numpy_strings(
    gateway: tuple[str, Seen],
) -> None:
    address, _ = gateway
    mixed = np.array([["é", b"\x00\xff"], ["", "long" * 100]], dtype=np.object_)
    async with AsyncClient(address, "echo") as client:
        out = await client.infer({"a": mixed, "b": np.array(["x", "yz"]), "c": "one"})
    assert out["a"].tolist() == [["é".encode(), b"\x00\xff"], [b"", b"long" * 100]]
    assert out["b"].tolist() == [b"x", b"yz"]
    assert out["c"].tolist() == [b"one"]


async def test_json_outputs_are_parsed(gateway: tuple[str, Seen]) -> None:
    address, _ = gateway
    async with AsyncClient(address, "json") as client:
        out = await client.infer({"x": np.ones(1, np.float32)})
    assert out["y"].dtype == np.int64 and out["y"].tolist() == [[1, 2], [3, 4]]
    assert out["s"].tolist() == [b"a", "bé".encode()]


@pytest.mark.parametrize(
    ("status", "error_type", "code"),
    [
        (400, BadInputError, ErrorCode.BAD_INPUT),
        (404, NotFoundError, ErrorCode.NOT_FOUND),
        (429, OverloadedError, ErrorCode.OVERLOADED),
        (500, InternalError, ErrorCode.INTERNAL),
        (503, UnavailableError, ErrorCode.UNAVAILABLE),
        (504, DeadlineError, ErrorCode.DEADLINE),
    ],
)
async def test_error_status_raises_its_exception(
    gateway: tuple[str, Seen], status: int, error_type: type[Exception], code: ErrorCode
) -> None:
    address, _ = gateway
    async with AsyncClient(address, f"status{status}") as client:
        with pytest.raises(error_type, match=f"failed with {status}") as caught:
            await client.infer({"x": np.ones(1, np.float32)})
    assert isinstance(caught.value, InferenceError) and caught.value.code == code
    assert caught.value.message == f"failed with {status}"


async def test_unmapped_status_raises_client_error_with_that_status(
    gateway: tuple[str, Seen],
) -> None:
    address, _ = gateway
    async with AsyncClient(address, "status401") as client:
        with pytest.raises(ClientError, match="failed with 401") as caught:
            await client.infer({"x": np.ones(1, np.float32)})
    assert caught.value.status == 401


def test_error_code_in_the_body_wins_over_the_status() -> None:
    lost = error_from_http(503, b'{"error": "rank 1 lost", "code": "rank_lost"}')
    assert isinstance(lost, UnavailableError) and lost.code == ErrorCode.RANK_LOST
    assert lost.message == "rank 1 lost"
    mismatch = error_from_http(500, b'{"error": "ranks disagree", "code": "rank_mismatch"}')
    assert isinstance(mismatch, InternalError) and mismatch.code == ErrorCode.RANK_MISMATCH
    not_json = error_from_http(502, b"<html>bad gateway</html>")
    assert isinstance(not_json, UnavailableError) and not_json.message == "<html>bad gateway</html>"
    assert isinstance(error_from_http(507, b""), InternalError)


async def test_total_timeout_raises_deadline_error(gateway: tuple[str, Seen]) -> None:
    address, _ = gateway
    async with AsyncClient(address, "slow", timeout=0.2) as client:
        with pytest.raises(DeadlineError, match="client timeout"):
            await client.infer({"x": np.ones(1, np.float32)})


async def test_unreachable_gateway_raises_transport_error() -> None:
    with socket.socket() as sock:  # a port that nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    async with AsyncClient(f"127.0.0.1:{port}", "matmul") as client:
        with pytest.raises(TransportError, match="cannot talk to") as caught:
            await client.infer({"x": np.ones(1, np.float32)})
    assert isinstance(caught.value, TransportError) and caught.value.status == 503


async def test_list_of_instances_is_sent_concurrently_and_answered_in_order(
    gateway: tuple[str, Seen],
) -> None:
    address, seen = gateway
    instances = [{"x": np.full(2, i, np.int32)} for i in range(2)]
    async with AsyncClient(address, "pair") as client:
        # "pair" answers only when both requests are in flight at once: sequential sending
        # would hang here until the timeout.
        out = await asyncio.wait_for(client.infer(instances, request_id="batch"), 30)
    assert [o["x"].tolist() for o in out] == [[0, 0], [1, 1]]
    assert sorted(h["X-Request-Id"] for h in seen.headers) == ["batch-0", "batch-1"]


async def test_a_failed_instance_fails_the_list_after_all_finished(
    gateway: tuple[str, Seen],
) -> None:
    address, seen = gateway
    good = {"x": np.ones(1, np.float32)}
    async with AsyncClient(address, "echo") as client:
        with pytest.raises(BadInputError, match="BYTES tensor") as caught:
            await client.infer([good, {"x": np.array([1, object()], dtype=np.object_)}])
        assert seen.bodies == []  # client-side checks run before anything is sent
        client.infer_url = client.infer_url.replace("echo", "status404")
        with pytest.raises(NotFoundError) as caught_remote:
            await client.infer([good, good])
    assert "while running instance 0" in (caught_remote.value.__notes__ or [])
    assert caught.value.code == ErrorCode.BAD_INPUT


async def test_one_session_and_one_connection_serve_sequential_calls(
    gateway: tuple[str, Seen],
) -> None:
    address, seen = gateway
    async with AsyncClient(address, "echo") as client:
        await client.infer({"x": np.ones(1, np.float32)})
        session = client._session
        for _ in range(4):
            await client.infer({"x": np.ones(1, np.float32)})
        assert client._session is session
    assert len(seen.bodies) == 5
    assert len(seen.peers) == 1  # keep-alive: every request came over the same socket


async def test_closed_async_client_refuses_calls(gateway: tuple[str, Seen]) -> None:
    address, _ = gateway
    client = AsyncClient(address, "echo")
    await client.close()
    await client.close()
    with pytest.raises(RuntimeError, match="closed"):
        await client.infer({"x": np.ones(1, np.float32)})


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="version_number"):
        AsyncClient("h:1", "m", version_number=-1)
    with pytest.raises(ValueError, match="scheme"):
        AsyncClient("ftp://h:1", "m")
    assert (
        AsyncClient("h:1/base/", "a b", tls=True).infer_url
        == "https://h:1/base/v2/models/a%20b:predict/infer"
    )


# ---------------------------------------------------------------- the blocking Client


async def test_sync_client_infer_and_infer_async(gateway: tuple[str, Seen]) -> None:
    address, seen = gateway
    x = {"x": np.ones((128, 96), np.float32)}

    def use_client() -> list[Any]:
        with Client(address, "matmul", "predict", version_number=0) as client:
            one = client.infer(x)
            many = client.infer([x, x])
            future = client.infer_async(x)
            return [one, many, future.result(timeout=30)]

    one, many, later = await asyncio.to_thread(use_client)
    assert np.all(one["y"] == -48.0)
    assert len(many) == 2 and all(np.all(m["y"] == -48.0) for m in many)
    assert np.all(later["y"] == -48.0)
    assert len(seen.peers) <= 2  # one pool: at most one socket per concurrent request


async def test_sync_client_future_can_be_awaited(gateway: tuple[str, Seen]) -> None:
    address, _ = gateway
    client = Client(address, "echo")
    missing = Client(address, "nothing")
    try:
        out = await client.infer_async({"x": np.arange(3, dtype=np.int16)})
        assert out["x"].tolist() == [0, 1, 2]
        with pytest.raises(NotFoundError, match="unknown model nothing"):
            await missing.infer_async({"x": np.ones(1, np.float32)})
    finally:
        await asyncio.to_thread(client.close)
        await asyncio.to_thread(missing.close)


async def test_sync_close_cancels_running_calls_and_is_final(gateway: tuple[str, Seen]) -> None:
    address, _ = gateway
    client = Client(address, "slow", timeout=600)
    future = client.infer_async({"x": np.ones(1, np.float32)})
    await asyncio.wait_for(gateway[1].first_request.wait(), 30)
    await asyncio.to_thread(client.close)
    await asyncio.to_thread(client.close)  # idempotent
    assert future.done()
    with pytest.raises(concurrent.futures.CancelledError):
        future.result()
    with pytest.raises(RuntimeError, match="closed"):
        client.infer({"x": 1})
    assert not client._life.thread.is_alive() and client._loop.is_closed()


def test_a_sync_client_never_closed_closes_at_exit_without_warnings() -> None:
    """The README's use without ``with``: a script that makes a call (which opens the
    connection pool) and just ends. Its finalizer closes the pool before the interpreter
    goes: no "Unclosed client session" on stderr, exit status 0."""
    closed_port = socket.socket()
    closed_port.bind(("127.0.0.1", 0))
    port = closed_port.getsockname()[1]
    closed_port.close()  # nothing listens: the call fails, but its session exists
    script = (
        "from shardserve.client import Client\n"
        f"client = Client('127.0.0.1:{port}', 'm', timeout=5)\n"
        "try:\n"
        "    client.generate('hi', max_tokens=1)\n"
        "except Exception as error:\n"
        "    print(type(error).__name__)\n"
    )
    done = subprocess.run(
        [sys.executable, "-X", "dev", "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "TransportError"
    assert done.stderr == ""

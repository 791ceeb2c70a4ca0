"""KServe v2 infer: JSON and binary codecs, every datatype, validation, error mapping."""

from __future__ import annotations

import gzip
import json
import struct
import time
import zlib
from typing import Any

import numpy as np
import pytest
from gateway_fakes import Gateway, MakeGateway, echo_servable, ok_reply, servable

from shardserve.errors import DeadlineError, ErrorCode, OverloadedError, http_status
from shardserve.wire.protocol import ErrorInfo, InferReply, InferRequest, InstanceResult
from shardserve.wire.tensors import Tensor

JSON = "application/json"
INFER = "/v2/models/matmul/infer"
HEADER = "Inference-Header-Content-Length"


def x_input(data: Any = None, **overrides: Any) -> dict[str, Any]:
    entry = {"name": "x", "shape": [128, 96], "datatype": "FP32", "data": data or [1.0] * 12288}
    entry.update(overrides)
    return entry


def binary_body(header: dict[str, Any], *blobs: bytes) -> tuple[bytes, dict[str, str]]:
    raw = json.dumps(header).encode()
    return raw + b"".join(blobs), {HEADER: str(len(raw))}


def split_binary(body: bytes, header_length: str) -> tuple[dict[str, Any], bytes]:
    n = int(header_length)
    return json.loads(body[:n]), body[n:]


async def post_error(gw: Gateway, body: Any, status: int, path: str = INFER) -> str:
    resp = await gw.client.post(
        path, data=json.dumps(body) if not isinstance(body, bytes) else body
    )
    assert resp.status == status, await resp.text()
    assert resp.headers["Content-Type"] == JSON
    payload = await resp.json()
    assert set(payload) <= {"error", "code"}
    if "code" in payload:  # the ErrorCode agrees with the HTTP status
        assert http_status(ErrorCode(payload["code"])) == status
    return str(payload["error"])


# ----------------------------------------------------------------- JSON success


async def test_json_infer_computes_and_echoes_id(gateway: Gateway) -> None:
    resp = await gateway.client.post(INFER, json={"id": "req-7", "inputs": [x_input()]})
    assert resp.status == 200
    assert resp.headers["Content-Type"] == JSON
    body = await resp.json()
    assert body["model_name"] == "matmul"
    assert body["id"] == "req-7"
    assert "model_version" not in body
    assert "null" not in await resp.text()
    y = body["outputs"][0]
    assert (y["name"], y["datatype"], y["shape"]) == ("y", "FP32", [128, 16])
    assert y["data"] == [-48.0] * 2048
    assert body["outputs"][1] == {"name": "s", "datatype": "FP32", "shape": [], "data": [-98304.0]}


async def test_nested_data_and_versioned_url(gateway: Gateway) -> None:
    nested = [[1.0] * 96 for _ in range(128)]
    resp = await gateway.client.post(
        "/v2/models/matmul/versions/1/infer", json={"inputs": [x_input(nested)]}
    )
    body = await resp.json()
    assert body["model_version"] == "1"
    assert "id" not in body
    request = gateway.dispatcher.requests[0]
    assert request.version == 1
    assert request.instances[0]["x"].to_numpy().shape == (128, 96)


async def test_integers_feed_an_fp32_input(gateway: Gateway) -> None:
    resp = await gateway.client.post(INFER, json={"inputs": [x_input([1] * 12288)]})
    assert resp.status == 200
    assert gateway.dispatcher.requests[0].instances[0]["x"].dtype == "<f4"


async def test_published_request_carries_servable_method_and_highest_ready_version(
    gateway: Gateway,
) -> None:
    await gateway.client.post(
        INFER, json={"inputs": [x_input()]}, headers={"X-Request-Id": "trace-1"}
    )
    request = gateway.dispatcher.requests[0]
    assert (request.servable, request.version, request.method) == ("matmul", 2, "predict")
    assert request.id == "trace-1"
    assert request.outputs is None


async def test_requested_outputs_are_honoured_in_order(gateway: Gateway) -> None:
    resp = await gateway.client.post(
        INFER, json={"inputs": [x_input()], "outputs": [{"name": "s"}, {"name": "y"}]}
    )
    body = await resp.json()
    assert [o["name"] for o in body["outputs"]] == ["s", "y"]
    assert gateway.dispatcher.requests[0].outputs == ("s", "y")


async def test_unknown_requested_output_is_400(gateway: Gateway) -> None:
    error = await post_error(gateway, {"inputs": [x_input()], "outputs": [{"name": "zzz"}]}, 400)
    assert error == "unknown output 'zzz'; outputs: ['y', 's']"
    assert gateway.dispatcher.requests == []


# ----------------------------------------------------------------- method selection


async def test_method_is_selected_by_model_name(gateway: Gateway) -> None:
    resp = await gateway.client.post(
        "/v2/models/matmul:predict_softmax/infer", json={"inputs": [x_input()]}
    )
    body = await resp.json()
    assert body["model_name"] == "matmul:predict_softmax"
    assert body["outputs"][0]["name"] == "p"
    assert gateway.dispatcher.requests[0].method == "predict_softmax"
    assert np.allclose(body["outputs"][0]["data"], 1 / 16)


async def test_unknown_method_is_404_and_method_parameter_is_refused(gateway: Gateway) -> None:
    error = await post_error(gateway, {"inputs": [x_input()]}, 404, "/v2/models/matmul:nope/infer")
    assert "unknown method 'nope'" in error
    body = {"inputs": [x_input()], "parameters": {"method": "predict_softmax"}}
    error = await post_error(gateway, body, 400)
    assert "'<servable>:<method>'" in error
    assert gateway.dispatcher.requests == []


# ----------------------------------------------------------------- every datatype

ROUND_TRIP = {
    "BOOL": [True, False, True, True],
    "UINT8": [0, 1, 254, 255],
    "UINT16": [0, 1, 65534, 65535],
    "UINT32": [0, 1, 2**32 - 2, 2**32 - 1],
    "UINT64": [0, 1, 2**63, 2**64 - 1],
    "INT8": [-128, -1, 0, 127],
    "INT16": [-(2**15), -1, 0, 2**15 - 1],
    "INT32": [-(2**31), -1, 0, 2**31 - 1],
    "INT64": [-(2**63), -1, 0, 2**63 - 1],
    "FP32": [0.5, -1.25, 3.0e38, -0.0],
    "FP64": [0.1, -1e308, 2.5, 1e-300],
    "BYTES": ["a", "", "héllo", "x" * 300],
}


@pytest.mark.parametrize("datatype", sorted(ROUND_TRIP))
async def test_every_datatype_round_trips_as_json(make_gateway: MakeGateway, datatype: str) -> None:
    gw = await make_gateway(echo_servable(datatype, (2, 2)))
    data = ROUND_TRIP[datatype]
    resp = await gw.client.post(
        "/v2/models/echo/infer",
        json={"inputs": [{"name": "x", "shape": [2, 2], "datatype": datatype, "data": data}]},
    )
    assert resp.status == 200, await resp.text()
    out = (await resp.json())["outputs"][0]
    assert (out["datatype"], out["shape"]) == (datatype, [2, 2])
    if datatype == "FP32":
        # Written with the shortest repr that reads back as the same float32 (3e+38 for
        # float32(3.0e38)), so compare as float32, bit for bit (-0.0 included).
        sent = np.asarray(data, dtype=np.float32)
        assert np.asarray(out["data"], dtype=np.float32).tobytes() == sent.tobytes()
    else:
        assert out["data"] == data


@pytest.mark.parametrize(
    ("datatype", "data", "problem"),
    [
        ("UINT8", [256], "UINT8 data holds values outside [0, 255]"),
        ("INT8", [-129], "INT8 data holds values outside [-128, 127]"),
        ("INT32", [1.5], "INT32 data must be integers"),
        ("BOOL", [1], "BOOL data must be booleans (true/false)"),
        ("FP32", ["a"], "FP32 data must be numbers"),
        ("FP64", [None], "FP64 data must be numbers"),
        ("BYTES", [1], "BYTES data must be strings"),
        ("INT4", [1], "unsupported datatype 'INT4'"),
    ],
)
async def test_values_that_do_not_fit_the_datatype_are_400(
    make_gateway: MakeGateway, datatype: str, data: list[Any], problem: str
) -> None:
    gw = await make_gateway(echo_servable(datatype, (1,)))
    body = {"inputs": [{"name": "x", "shape": [1], "datatype": datatype, "data": data}]}
    error = await post_error(gw, body, 400, "/v2/models/echo/infer")
    assert error == f"input 'x': {problem}"


@pytest.mark.parametrize(
    ("datatype", "data"),
    [("FP32", [1.5, True]), ("INT32", [[1], [False]]), ("FP64", [False, 2.0])],
)
async def test_booleans_among_numbers_are_400_not_read_as_one_and_zero(
    make_gateway: MakeGateway, datatype: str, data: list[Any]
) -> None:
    gw = await make_gateway(echo_servable(datatype, (2,)))
    body = {"inputs": [{"name": "x", "shape": [2], "datatype": datatype, "data": data}]}
    error = await post_error(gw, body, 400, "/v2/models/echo/infer")
    assert error == f"input 'x': {datatype} data must be numbers"


async def test_an_id_that_is_not_valid_unicode_is_400(make_gateway: MakeGateway) -> None:
    gw = await make_gateway(echo_servable("FP32", (1,)))
    body = b'{"id":"\\ud800","inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1]}]}'
    error = await post_error(gw, body, 400, "/v2/models/echo/infer")
    assert error == "'id' must be valid Unicode"


@pytest.mark.parametrize("datatype", ["FP16", "BF16"])
async def test_half_precision_via_json_is_refused_with_tritons_words(
    make_gateway: MakeGateway, datatype: str
) -> None:
    gw = await make_gateway(echo_servable(datatype, (1,)))
    body = {"inputs": [{"name": "x", "shape": [1], "datatype": datatype, "data": [1.0]}]}
    error = await post_error(gw, body, 400, "/v2/models/echo/infer")
    assert error == (
        f"receiving {datatype} data via JSON is not supported. "
        "Please use the binary data format for input 'x'"
    )


# ----------------------------------------------------------------- binary extension


async def test_binary_in_and_out_byte_exact(gateway: Gateway) -> None:
    x = np.arange(128 * 96, dtype=np.float32).reshape(128, 96) / 1000
    header = {
        "inputs": [
            {
                "name": "x",
                "shape": [128, 96],
                "datatype": "FP32",
                "parameters": {"binary_data_size": x.nbytes},
            }
        ],
        "parameters": {"binary_data_output": True},
    }
    body, headers = binary_body(header, x.tobytes())
    resp = await gateway.client.post(INFER, data=body, headers=headers)
    assert resp.status == 200
    assert resp.headers["Content-Type"] == "application/octet-stream"
    doc, blobs = split_binary(await resp.read(), resp.headers[HEADER])
    expected_y = -(x @ np.full((96, 16), 0.5, dtype=np.float32))
    assert doc["outputs"][0] == {
        "name": "y",
        "datatype": "FP32",
        "shape": [128, 16],
        "parameters": {"binary_data_size": expected_y.nbytes},
    }
    assert blobs[: expected_y.nbytes] == expected_y.tobytes()
    assert len(blobs) == expected_y.nbytes + 4
    assert gateway.dispatcher.requests[0].instances[0]["x"].data == x.tobytes()


async def test_per_output_binary_flag_overrides_request_flag(gateway: Gateway) -> None:
    body = {
        "inputs": [x_input()],
        "outputs": [{"name": "y", "parameters": {"binary_data": False}}, {"name": "s"}],
        "parameters": {"binary_data_output": True},
    }
    resp = await gateway.client.post(INFER, json=body)
    doc, blob = split_binary(await resp.read(), resp.headers[HEADER])
    assert doc["outputs"][0]["data"] == [-48.0] * 2048
    assert doc["outputs"][1]["parameters"] == {"binary_data_size": 4}
    assert blob == struct.pack("<f", -98304.0)


@pytest.mark.parametrize("datatype", ["FP16", "BYTES", "BOOL", "UINT64", "INT8"])
async def test_binary_round_trip_per_datatype(make_gateway: MakeGateway, datatype: str) -> None:
    gw = await make_gateway(echo_servable(datatype, (3,)))
    raw = {
        "FP16": np.asarray([1.5, -2.0, 65504.0], dtype="<f2").tobytes(),
        "BYTES": b"".join(struct.pack("<I", len(s)) + s for s in (b"ab", b"", b"\xff\x00")),
        "BOOL": bytes([1, 0, 1]),
        "UINT64": np.asarray([0, 1, 2**64 - 1], dtype="<u8").tobytes(),
        "INT8": np.asarray([-128, 0, 127], dtype="i1").tobytes(),
    }[datatype]
    header = {
        "inputs": [
            {
                "name": "x",
                "shape": [3],
                "datatype": datatype,
                "parameters": {"binary_data_size": len(raw)},
            }
        ],
        "outputs": [{"name": "y", "parameters": {"binary_data": True}}],
    }
    body, headers = binary_body(header, raw)
    resp = await gw.client.post("/v2/models/echo/infer", data=body, headers=headers)
    assert resp.status == 200, await resp.text()
    doc, blob = split_binary(await resp.read(), resp.headers[HEADER])
    assert doc["outputs"][0]["datatype"] == datatype
    assert blob == raw


async def test_mixed_binary_and_json_inputs(make_gateway: MakeGateway) -> None:
    from shardserve.wire.protocol import MethodStatus, TensorSpec

    method = MethodStatus(
        name="predict",
        inputs=(
            TensorSpec(name="a", datatype="INT32", shape=(2,)),
            TensorSpec(name="b", datatype="UINT8", shape=(3,)),
        ),
        outputs=(TensorSpec(name="y", datatype="INT32", shape=(2,)),),
    )

    def handler(request: InferRequest) -> InferReply:
        return ok_reply(request, [{"y": request.instances[0]["a"]}])

    gw = await make_gateway(servable("mix", 1, (method,)), handler=handler)
    header = {
        "inputs": [
            {"name": "a", "shape": [2], "datatype": "INT32", "data": [7, -7]},
            {"name": "b", "shape": [3], "datatype": "UINT8", "parameters": {"binary_data_size": 3}},
        ]
    }
    body, headers = binary_body(header, b"\x01\x02\x03")
    resp = await gw.client.post("/v2/models/mix/infer", data=body, headers=headers)
    assert (await resp.json())["outputs"][0]["data"] == [7, -7]
    assert gw.dispatcher.requests[0].instances[0]["b"].data == b"\x01\x02\x03"


@pytest.mark.parametrize(
    ("header_value", "size", "blob", "problem"),
    [
        ("abc", 16, b"", "Unable to parse Inference-Header-Content-Length"),
        ("999999", 16, b"", "inference header size should be in range"),
        (None, 16, b"", "must specify valid 'Inference-Header-Content-Length'"),
        ("", 8, b"\x00" * 4, "unexpected size for input 'x', expecting 8 additional bytes"),
        ("", 4, b"\x00" * 8, "request has 4 bytes of binary data that no input claims"),
        ("", 8, b"\x00" * 8, "binary_data_size is 8 bytes, shape [1] of FP32 needs 4"),
    ],
)
async def test_bad_binary_requests_are_400(
    make_gateway: MakeGateway, header_value: str | None, size: int, blob: bytes, problem: str
) -> None:
    gw = await make_gateway(echo_servable("FP32", (1,)))
    header = {
        "inputs": [
            {
                "name": "x",
                "shape": [1],
                "datatype": "FP32",
                "parameters": {"binary_data_size": size},
            }
        ]
    }
    raw = json.dumps(header).encode()
    headers = {}
    if header_value is not None:
        headers[HEADER] = header_value or str(len(raw))
    resp = await gw.client.post("/v2/models/echo/infer", data=raw + blob, headers=headers)
    assert resp.status == 400
    assert problem in (await resp.json())["error"]


async def test_data_and_binary_size_together_are_400(gateway: Gateway) -> None:
    entry = x_input(parameters={"binary_data_size": 4})
    error = await post_error(gateway, {"inputs": [entry]}, 400)
    assert "Input must set only one of the following fields" in error


# ----------------------------------------------------------------- compression and size


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_compressed_request_bodies(gateway: Gateway, encoding: str) -> None:
    raw = json.dumps({"inputs": [x_input()]}).encode()
    packed = gzip.compress(raw) if encoding == "gzip" else zlib.compress(raw)
    resp = await gateway.client.post(INFER, data=packed, headers={"Content-Encoding": encoding})
    assert resp.status == 200
    assert (await resp.json())["outputs"][0]["data"][0] == -48.0


async def test_unknown_content_encoding_is_415(gateway: Gateway) -> None:
    resp = await gateway.client.post(INFER, data=b"xx", headers={"Content-Encoding": "br"})
    assert resp.status == 415
    assert resp.headers["Content-Type"] == JSON
    assert resp.headers["Accept-Encoding"] == "gzip, deflate"


async def test_gzip_bomb_is_413_not_memory(make_gateway: MakeGateway) -> None:
    gw = await make_gateway(max_body_bytes=1024 * 1024)
    bomb = gzip.compress(b"\x00" * (256 * 1024 * 1024), compresslevel=9)  # ~250 KiB
    assert len(bomb) < 1024 * 1024
    resp = await gw.client.post(INFER, data=bomb, headers={"Content-Encoding": "gzip"})
    assert resp.status == 413
    assert resp.headers["Content-Type"] == JSON
    assert "limit of 1 MiB" in (await resp.json())["error"]
    assert gw.dispatcher.requests == []


async def test_plain_body_over_the_limit_is_413(make_gateway: MakeGateway) -> None:
    gw = await make_gateway(max_body_bytes=1000)
    resp = await gw.client.post(INFER, data=b"x" * 5000)
    assert resp.status == 413
    assert "limit of 1000 bytes" in (await resp.json())["error"]


# ----------------------------------------------------------------- validation (nothing published)


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (b"not json", 400, "request body is not valid JSON"),
        (b"[1, 2]", 400, "request body must be a JSON object"),
        ({"inputs": []}, 400, "'inputs' must be a non-empty list"),
        ({"inputs": [x_input(name="z")]}, 400, "missing input(s): x; expected ['x']"),
        (
            {"inputs": [x_input(), x_input(name="extra")]},
            400,
            "unexpected input(s): extra; expected ['x']",
        ),
        (
            {"inputs": [x_input(shape=[96, 128])]},
            400,
            "input 'x' has shape [96, 128], expected [128, 96]",
        ),
        (
            {"inputs": [x_input([1.0] * 12288, datatype="FP64")]},
            400,
            "input 'x' has datatype FP64, expected FP32",
        ),
        (
            {"inputs": [x_input([1.0] * 12287)]},
            400,
            "input 'x': data has 12287 elements, shape [128, 96] needs 12288",
        ),
        ({"inputs": [x_input(shape=[128, -96])]}, 400, "shape [128, -96] has a negative dimension"),
        (
            {"inputs": [x_input(shape=[2**40, 2**40])]},
            400,
            "overflows a 64-bit element count",
        ),
        ({"inputs": [x_input(shape=[2**33, 2**20])]}, 400, "data has 12288 elements"),
        ({"inputs": [x_input(shape="big")]}, 400, "shape must be a list of integers"),
        ({"inputs": [x_input(), x_input()]}, 400, "input 'x' is given more than once"),
        ({"inputs": [x_input()], "id": 5}, 400, "'id' must be a string"),
    ],
)
async def test_bad_requests_never_reach_the_broker(
    gateway: Gateway, body: Any, status: int, message: str
) -> None:
    error = await post_error(gateway, body, status)
    assert message in error
    assert gateway.dispatcher.requests == []


async def test_unknown_model_is_404_even_with_a_bad_body(gateway: Gateway) -> None:
    error = await post_error(gateway, b"garbage", 404, "/v2/models/nope/infer")
    assert error == "unknown model 'nope'"
    assert gateway.dispatcher.requests == []


async def test_unready_version_is_503_before_publishing(make_gateway: MakeGateway) -> None:
    from gateway_fakes import MATMUL_METHODS

    gw = await make_gateway(
        servable("matmul", 1, MATMUL_METHODS, ready=False, reason="rank 1 lost")
    )
    error = await post_error(gw, {"inputs": [x_input()]}, 503)
    assert error == "model 'matmul' version 1 is not ready: rank 1 lost"
    assert gw.dispatcher.requests == []


# ----------------------------------------------------------------- outcomes from the mesh


def failing(code: ErrorCode, message: str, *, per_instance: bool = False) -> Any:
    def handler(request: InferRequest) -> InferReply:
        error = ErrorInfo(code=code, message=message)
        if per_instance:
            return InferReply(
                id=request.id,
                servable=request.servable,
                instances=(InstanceResult(error=error),),
            )
        return InferReply(id=request.id, servable=request.servable, error=error)

    return handler


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (ErrorCode.BAD_INPUT, 400),
        (ErrorCode.NOT_FOUND, 404),
        (ErrorCode.UNAVAILABLE, 503),
        (ErrorCode.OVERLOADED, 503),
        (ErrorCode.RANK_LOST, 503),
        (ErrorCode.DEADLINE, 504),
        (ErrorCode.RANK_MISMATCH, 500),
        (ErrorCode.STAGE_FAILED, 500),
    ],
)
@pytest.mark.parametrize("per_instance", [False, True])
async def test_reply_errors_map_to_statuses(
    make_gateway: MakeGateway, code: ErrorCode, status: int, per_instance: bool
) -> None:
    gw = await make_gateway(handler=failing(code, f"boom {code}", per_instance=per_instance))
    error = await post_error(gw, {"inputs": [x_input()]}, status)
    assert error == f"boom {code}"


async def test_dispatcher_errors_map_to_statuses(make_gateway: MakeGateway) -> None:
    def deadline(request: InferRequest) -> InferReply:
        raise DeadlineError("deadline exceeded: no reply within 1 s")

    def overloaded(request: InferRequest) -> InferReply:
        raise OverloadedError("overloaded: queue is full")

    for handler, status in ((deadline, 504), (overloaded, 503)):
        gw = await make_gateway(handler=handler)
        await post_error(gw, {"inputs": [x_input()]}, status)


async def test_broker_down_is_503(make_gateway: MakeGateway) -> None:
    from shardserve.errors import UnavailableError

    def down(request: InferRequest) -> InferReply:
        raise UnavailableError("message broker is unreachable")

    gw = await make_gateway(handler=down)
    assert await post_error(gw, {"inputs": [x_input()]}, 503) == "message broker is unreachable"


async def test_non_utf8_bytes_output_as_json_is_refused(make_gateway: MakeGateway) -> None:
    def handler(request: InferRequest) -> InferReply:
        raw = struct.pack("<I", 1) + b"\xff"
        return ok_reply(request, [{"y": Tensor(dtype="bytes", shape=(1,), data=raw)}])

    gw = await make_gateway(echo_servable("BYTES", (1,)), handler=handler)
    body = {"inputs": [{"name": "x", "shape": [1], "datatype": "BYTES", "data": ["a"]}]}
    error = await post_error(gw, body, 400, "/v2/models/echo/infer")
    assert "not UTF-8; request it with binary_data" in error


# ----------------------------------------------------------------- deadlines


async def test_timeout_header_and_parameter_set_the_deadline(gateway: Gateway) -> None:
    before = time.time()
    await gateway.client.post(
        INFER, json={"inputs": [x_input()]}, headers={"X-Request-Timeout": "2.5"}
    )
    await gateway.client.post(
        INFER, json={"inputs": [x_input()], "parameters": {"timeout_ms": 1500}}
    )
    await gateway.client.post(
        INFER, json={"inputs": [x_input()]}, headers={"X-Request-Timeout": "100000"}
    )
    after = time.time()
    first, second, capped = gateway.dispatcher.requests
    assert before + 2.5 <= first.deadline <= after + 2.5
    assert before + 1.5 <= second.deadline <= after + 1.5
    assert before + 300 <= capped.deadline <= after + 300


@pytest.mark.parametrize("value", ["soon", "-1", "0", "nan"])
async def test_bad_timeout_header_is_400(gateway: Gateway, value: str) -> None:
    resp = await gateway.client.post(
        INFER, json={"inputs": [x_input()]}, headers={"X-Request-Timeout": value}
    )
    assert resp.status == 400
    assert gateway.dispatcher.requests == []

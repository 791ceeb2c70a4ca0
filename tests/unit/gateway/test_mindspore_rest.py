"""MindSpore Serving REST: URL forms, instance formats, casts, b64, per-instance errors."""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import pytest
from gateway_fakes import Gateway, MakeGateway, ok_reply, servable

from shardserve.errors import BadInputError, ErrorCode
from shardserve.wire.protocol import (
    ErrorInfo,
    InferReply,
    InferRequest,
    InstanceResult,
    MethodStatus,
    TensorSpec,
)
from shardserve.wire.tensors import Tensor
from shardserve_gateway.codecs.json_tensors import to_tensor

JSON = "application/json"
ONES = [[1.0] * 96 for _ in range(128)]


async def post(gw: Gateway, path: str, body: Any) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body)
    resp = await gw.client.post(path, data=data)
    assert resp.headers["Content-Type"] == JSON
    return resp.status, await resp.json()


async def test_predict_with_nested_floats(gateway: Gateway) -> None:
    status, body = await post(gateway, "/model/matmul:predict", {"instances": [{"x": ONES}]})
    assert status == 200
    (instance,) = body["instances"]
    assert instance["y"] == [[-48.0] * 16] * 128
    assert instance["s"] == -98304.0  # shape [] -> JSON scalar
    request = gateway.dispatcher.requests[0]
    assert (request.servable, request.version, request.method) == ("matmul", 2, "predict")


async def test_object_instance_version_and_other_method(gateway: Gateway) -> None:
    status, body = await post(
        gateway, "/model/matmul/version/1:predict_softmax", {"instances": {"x": ONES}}
    )
    assert status == 200
    assert np.allclose(body["instances"][0]["p"], 1 / 16)
    assert gateway.dispatcher.requests[0].version == 1


async def test_integers_are_cast_to_the_signature_type(gateway: Gateway) -> None:
    status, _ = await post(
        gateway, "/model/matmul:predict", {"instances": [{"x": [[1] * 96] * 128}]}
    )
    assert status == 200
    assert gateway.dispatcher.requests[0].instances[0]["x"].dtype == "<f4"


def typed_servable(datatype: str, shape: tuple[int, ...]) -> Any:
    method = MethodStatus(
        name="predict",
        inputs=(TensorSpec(name="x", datatype=datatype, shape=shape),),
        outputs=(TensorSpec(name="y", datatype=datatype, shape=shape),),
    )
    return servable("t", 1, (method,))


def echo(request: InferRequest) -> InferReply:
    return ok_reply(request, [{"y": i["x"]} for i in request.instances])


@pytest.mark.parametrize(
    ("datatype", "value", "dtype"),
    [
        ("INT64", [1, 2], "<i8"),
        ("UINT8", [0, 255], "|u1"),
        ("INT32", [1.0, 2.0], "<i4"),  # integral floats fit an integer type
        ("FP64", [1, 2.5], "<f8"),
        ("BOOL", [True, False], "|b1"),
    ],
)
async def test_casts_that_fit(
    make_gateway: MakeGateway, datatype: str, value: list[Any], dtype: str
) -> None:
    gw = await make_gateway(typed_servable(datatype, (2,)), handler=echo)
    status, body = await post(gw, "/model/t:predict", {"instances": [{"x": value}]})
    assert status == 200, body
    assert gw.dispatcher.requests[0].instances[0]["x"].dtype == dtype
    assert body["instances"][0]["y"] == value


@pytest.mark.parametrize(
    ("datatype", "value", "message"),
    [
        ("UINT8", [1, 300], "input 'x': UINT8 data holds values outside [0, 255]"),
        ("INT32", [1.5, 2.0], "input 'x': INT32 data must be integers (got non-integral numbers)"),
        ("FP32", [True, False], "input 'x': FP32 data must be numbers"),
        ("FP32", None, "input 'x': json value is null, it is not supported"),
        ("FP32", [], "input 'x': json array, shape is empty"),
        ("FP32", [[1.0], [1.0, 2.0]], "input 'x': invalid json array"),
        ("FP32", [{"a": 1}, 2], "json array, data should be number, bool, string or bytes"),
        ("BYTES", ["a", "\ud800"], "input 'x': a string that is not valid Unicode"),
        ("FP32", [1.5, True], "input 'x': json array, elements type is not equal"),
        ("BYTES", ["a", 1], "input 'x': json array, elements type is not equal"),
    ],
)
async def test_values_that_do_not_fit(
    make_gateway: MakeGateway, datatype: str, value: Any, message: str
) -> None:
    gw = await make_gateway(typed_servable(datatype, (2,)), handler=echo)
    status, body = await post(gw, "/model/t:predict", {"instances": [{"x": value}]})
    assert status == 400
    assert message in body["error_msg"]
    assert gw.dispatcher.requests == []


async def test_b64_numeric_input(make_gateway: MakeGateway) -> None:
    gw = await make_gateway(typed_servable("INT16", (3, 2)), handler=echo)
    value = {"b64": "AQACAAIAAwADAAQA", "type": "int16", "shape": [3, 2]}
    status, body = await post(gw, "/model/t:predict", {"instances": [{"x": value}]})
    assert status == 200, body
    assert body["instances"][0]["y"] == [[1, 2], [2, 3], [3, 4]]


async def test_b64_bytes_in_and_out(make_gateway: MakeGateway) -> None:
    gw = await make_gateway(typed_servable("BYTES", ()), handler=echo)
    raw = b"\x00\xffbinary"
    value = {"b64": base64.b64encode(raw).decode()}
    status, body = await post(gw, "/model/t:predict", {"instances": [{"x": value}]})
    assert status == 200, body
    assert body["instances"][0]["y"] == {"b64": base64.b64encode(raw).decode()}


async def test_plain_string_becomes_bytes(make_gateway: MakeGateway) -> None:
    gw = await make_gateway(typed_servable("BYTES", ()), handler=echo)
    status, body = await post(gw, "/model/t:predict", {"instances": {"x": "héllo"}})
    assert status == 200
    assert base64.b64decode(body["instances"][0]["y"]["b64"]) == "héllo".encode()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"b64": "!!!"}, "'!!!' is illegal b64 encode string"),
        ({"b64": "AAA=", "type": "dtype_unknow"}, "specified type:'dtype_unknow' is illegal"),
        (
            {"b64": "AAAA", "type": "fp16", "shape": [3]},
            "size is not matched, decode base64 size:3",
        ),
        ({"b64": "AA==", "junk": 1}, "key is not ['b64', 'type', 'shape'], fail key:junk"),
        ({"b64": "AA==", "shape": [-1]}, "key is 'shape', array value should be unsigned integer"),
        ({"b64": 5}, "type is string, but json is not string type"),
        ({"b64": "AA==", "shape": [2]}, "only support scalar when data type is string or bytes"),
    ],
)
async def test_bad_b64_values(make_gateway: MakeGateway, value: Any, message: str) -> None:
    gw = await make_gateway(typed_servable("FP16", (3,)), handler=echo)
    status, body = await post(gw, "/model/t:predict", {"instances": [{"x": value}]})
    assert status == 400
    assert message in body["error_msg"]


@pytest.mark.parametrize(
    ("path", "status", "message"),
    [
        ("/model/matmul", 400, "the keyword:[service method] must contain."),
        ("/model/matmul:", 400, "the keyword:[service method] must contain."),
        ("/model/:predict", 400, "the keyword:[model] must contain."),
        ("/model/matmul/version/x:predict", 400, "keyword:[version] value invalid"),
        ("/model/matmul/version/4294967295:predict", 400, "version number range failed"),
        ("/model/nope:predict", 404, "unknown model 'nope'"),
        ("/model/matmul/version/7:predict", 404, "unknown version 7"),
        ("/model/matmul:nope", 404, "unknown method 'nope'"),
    ],
)
async def test_url_errors(gateway: Gateway, path: str, status: int, message: str) -> None:
    got, body = await post(gateway, path, {"instances": [{"x": ONES}]})
    assert got == status
    assert set(body) == {"error_msg"}
    assert message in body["error_msg"]


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"{not json", "Illegal JSON format"),
        (b'{"instances": []}', "instances value is array type, but no value"),
        (b'{"instances": 3}', "instances no key mode is not supported"),
        (b'{"instances": [1]}', "json array, instance is not object type"),
        (b'{"instances": [{}]}', "json array, instance is object type, but no value"),
        (b'{"other": 1}', "key 'instances' expects to exist once, but actually 0 times"),
        (b'{"instances": {"x": 1}, "instances": {"x": 2}}', "but actually 2 times"),
    ],
)
async def test_body_errors(gateway: Gateway, raw: bytes, message: str) -> None:
    status, body = await post(gateway, "/model/matmul:predict", raw)
    assert status == 400
    assert message in body["error_msg"]


async def test_missing_input_names_the_instance_and_extra_keys_are_ignored(
    gateway: Gateway,
) -> None:
    body = {"instances": [{"x": ONES, "note": "ignored"}, {"z": 1}]}
    status, reply = await post(gateway, "/model/matmul:predict", body)
    assert status == 400
    assert reply["error_msg"] == "instance 1: missing input(s): x; expected ['x']"
    assert gateway.dispatcher.requests == []


async def test_wrong_shape_is_400(gateway: Gateway) -> None:
    status, reply = await post(gateway, "/model/matmul:predict", {"instances": {"x": [1.0, 2.0]}})
    assert status == 400
    assert reply["error_msg"] == "input 'x' has shape [2], expected [128, 96]"


def instance_errors(*messages: str | None) -> Any:
    def handler(request: InferRequest) -> InferReply:
        results = []
        for message in messages:
            if message is None:
                y = Tensor.from_numpy(np.zeros((128, 16), np.float32))
                results.append(InstanceResult(outputs={"y": y, "s": to_tensor(np.asarray(0.0))}))
            else:
                error = ErrorInfo(code=ErrorCode.STAGE_FAILED, message=message)
                results.append(InstanceResult(error=error))
        return InferReply(id=request.id, servable=request.servable, instances=tuple(results))

    return handler


async def test_partial_failure_is_200_with_per_instance_error(make_gateway: MakeGateway) -> None:
    gw = await make_gateway(handler=instance_errors(None, "Preprocess Failed"))
    status, body = await post(gw, "/model/matmul:predict", {"instances": [{"x": ONES}] * 2})
    assert status == 200
    assert body["instances"][0]["s"] == 0.0
    assert body["instances"][1] == {"error_msg": "Preprocess Failed"}


async def test_identical_failures_collapse_to_one_error(make_gateway: MakeGateway) -> None:
    gw = await make_gateway(handler=instance_errors("boom", "boom"))
    status, body = await post(gw, "/model/matmul:predict", {"instances": [{"x": ONES}] * 2})
    assert status == 500
    assert body == {"error_msg": "boom"}


async def test_different_failures_stay_per_instance(make_gateway: MakeGateway) -> None:
    gw = await make_gateway(handler=instance_errors("a", "b"))
    status, body = await post(gw, "/model/matmul:predict", {"instances": [{"x": ONES}] * 2})
    assert status == 500
    assert body == {"instances": [{"error_msg": "a"}, {"error_msg": "b"}]}


async def test_whole_request_error_uses_error_msg(make_gateway: MakeGateway) -> None:
    def handler(request: InferRequest) -> InferReply:
        error = ErrorInfo(code=ErrorCode.RANK_LOST, message="rank 1 lost")
        return InferReply(id=request.id, servable=request.servable, error=error)

    gw = await make_gateway(handler=handler)
    status, body = await post(gw, "/model/matmul:predict", {"instances": [{"x": ONES}]})
    assert (status, body) == (503, {"error_msg": "rank 1 lost"})


async def test_get_is_405_with_error_msg(gateway: Gateway) -> None:
    resp = await gateway.client.get("/model/matmul:predict")
    assert resp.status == 405
    assert "error_msg" in await resp.json()


MS_BODIES = [
    b'{"instances":[{"x":[[1.5,2],[3,4e2]]}]}',
    b'{"instances":{"x":[1,2]},"instances":{"x":[3]}}',
    b'{"instances":[{"x":1,"x":2.5}]}',
    b'{"instance\\u0073":[{"x":1}],"instances":[{"x":2}]}',
    b'{"instances":[{"x":[NaN, Infinity]}]}',
    b'{"instances":[{"x":[1e400]}]}',
    b'{"instances":[{"x":[18446744073709551616, -9223372036854775809]}]}',
    b'{"instances":[{"x":[18446744073709551615, -0, -0.0]}]}',
    b'{"instances":[{"x":"\\ud800"}]}',
    b'{"instances":[{"x":"caf\xc3\xa9"}]}',
    b'{"instances":[{"x":1}],}',
    b'{"instances":[{"x":1}]} [1]',
    b'\xef\xbb\xbf{"instances":[{"x":1}]}',
    b'{"instances":[]}',
    b'{"instances":5}',
    b'{"other":[{"x":1}]}',
    b"[" * 1100 + b"]" * 1100,
]


def _outcome_of(parse: Any, raw: bytes) -> Any:
    try:
        return ("ok", repr(parse(raw)))
    except BadInputError as exc:
        return ("error", exc.message)


@pytest.mark.parametrize("raw", MS_BODIES, ids=range(len(MS_BODIES)))
def test_fast_instance_parsing_decides_as_the_standard_library(
    raw: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardserve_gateway.codecs import mindspore as mindspore_codec

    fast = _outcome_of(mindspore_codec.parse_instances, raw)
    monkeypatch.setattr(mindspore_codec, "_fast_load", lambda raw: None)
    assert fast == _outcome_of(mindspore_codec.parse_instances, raw)


def test_a_plain_numeric_body_takes_the_fast_path() -> None:
    from shardserve_gateway.codecs import mindspore as mindspore_codec

    assert mindspore_codec._fast_load(MS_BODIES[0]) == {
        "instances": [{"x": [[1.5, 2], [3, 400.0]]}]
    }


def test_reply_values_are_the_doubles_tolist_gives_whatever_the_writer() -> None:
    from shardserve_gateway.codecs.mindspore import reply_body, tensor_to_json

    rng = np.random.default_rng(5)
    outputs = {
        "f": rng.standard_normal((4, 3)).astype(np.float32),
        "i": np.array([[-3, 7]], dtype=np.int64),
        "b": np.array([True, False]),
        "s": np.array(2.5, dtype=np.float32),  # shape []: a JSON scalar
    }
    doc = {"instances": [{k: tensor_to_json(Tensor.from_numpy(v)) for k, v in outputs.items()}]}
    back = json.loads(reply_body(doc))["instances"][0]
    assert back == {k: v.tolist() for k, v in outputs.items()}
    assert back["f"] == outputs["f"].tolist()  # doubles of the float32s, not their shortest repr


def test_non_finite_reply_values_are_written_as_before() -> None:
    from shardserve_gateway.codecs.mindspore import reply_body, tensor_to_json

    values = np.array([np.nan, np.inf, 1.5], dtype=np.float32)
    doc = {"instances": [{"y": tensor_to_json(Tensor.from_numpy(values))}]}
    assert reply_body(doc) == b'{"instances":[{"y":[NaN,Infinity,1.5]}]}'

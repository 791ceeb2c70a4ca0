"""ModelInferRequest decoding through the REST codec, and responses: pure, no server."""

from __future__ import annotations

import numpy as np
import pytest

from shardserve.errors import (
    BadInputError,
    DeadlineError,
    InternalError,
    NotFoundError,
    OverloadedError,
    UnavailableError,
)
from shardserve.wire.tensors import Tensor
from shardserve_gateway.grpcapi.calls import status_code
from shardserve_gateway.grpcapi.infer_codec import decode_infer, encode_infer
from shardserve_gateway.grpcapi.protocol import grpc_service_pb2 as pb
from shardserve_gateway.grpcapi.server import parse
from shardserve_gateway.grpcapi.transport.wire import StatusCode


def request_with(datatype: str, shape: list[int]) -> tuple[pb.ModelInferRequest, object]:
    request = pb.ModelInferRequest(model_name="m", id="r1")
    tensor = request.inputs.add(name="x", datatype=datatype, shape=shape)
    return request, tensor


def test_raw_contents_become_the_tensor_bytes() -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    request, _ = request_with("FP32", [2, 3])
    request.raw_input_contents.append(x.tobytes())
    parsed = decode_infer(request)
    assert parsed.id == "r1"
    np.testing.assert_array_equal(parsed.inputs["x"].to_numpy(), x)


def test_typed_contents_are_read_by_datatype() -> None:
    request, tensor = request_with("INT64", [3])
    tensor.contents.int64_contents.extend([1, -2, 3])  # type: ignore[attr-defined]
    np.testing.assert_array_equal(decode_infer(request).inputs["x"].to_numpy(), [1, -2, 3])


def test_bytes_contents_keep_their_bytes() -> None:
    request, tensor = request_with("BYTES", [2])
    tensor.contents.bytes_contents.extend([b"ab", b"\xff"])  # type: ignore[attr-defined]
    assert list(decode_infer(request).inputs["x"].to_numpy()) == [b"ab", b"\xff"]


@pytest.mark.parametrize(
    ("build", "words"),
    [
        (lambda r, t: r.raw_input_contents.extend([b"", b""]), "2 entries for 1 inputs"),
        (lambda r, t: t.contents.int_contents.extend([1, 2, 3]), "fp32_contents"),
        (lambda r, t: t.contents.fp32_contents.extend([1.0]), "shape"),
        (lambda r, t: r.raw_input_contents.append(b"\x00" * 5), "binary_data_size is 5"),
        (
            lambda r, t: (
                r.raw_input_contents.append(b"\x00" * 12),
                t.contents.fp32_contents.append(1.0),
            ),
            "both contents and raw_input_contents",
        ),
        (lambda r, t: r.parameters["method"].Clear(), "parameter 'method' has no value"),
    ],
)
def test_bad_requests_are_refused_naming_the_problem(build: object, words: str) -> None:
    request, tensor = request_with("FP32", [3])
    build(request, tensor)  # type: ignore[operator]
    with pytest.raises(BadInputError) as raised:
        decode_infer(request)
    assert words in raised.value.message


def test_half_precision_travels_only_raw() -> None:
    request, tensor = request_with("FP16", [1])
    with pytest.raises(BadInputError, match="only in raw_input_contents"):
        decode_infer(request)


def test_a_method_parameter_is_refused_as_in_rest() -> None:
    request, _ = request_with("FP32", [1])
    request.raw_input_contents.append(b"\x00" * 4)
    request.parameters["method"].string_param = "other"
    with pytest.raises(BadInputError, match="<servable>:<method>"):
        decode_infer(request)


def test_responses_put_every_output_in_raw_contents() -> None:
    y = np.full((2, 2), -48.0, np.float32)
    tensor = Tensor.from_numpy(y)
    response = encode_infer(
        model_name="m", model_version="1", request_id="r", outputs=[("y", tensor, False)]
    )
    assert [(o.name, o.datatype, list(o.shape)) for o in response.outputs] == [
        ("y", "FP32", [2, 2])
    ]
    assert response.raw_output_contents[0] == y.tobytes()


def test_malformed_bytes_are_bad_input() -> None:
    with pytest.raises(BadInputError, match="inference.ModelInferRequest"):
        parse(pb.ModelInferRequest, b"\xff\xff\xff\xff\x0f")


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (BadInputError("x"), StatusCode.INVALID_ARGUMENT),
        (NotFoundError("x"), StatusCode.NOT_FOUND),
        (UnavailableError("x"), StatusCode.UNAVAILABLE),
        (OverloadedError("x"), StatusCode.UNAVAILABLE),
        (DeadlineError("x"), StatusCode.DEADLINE_EXCEEDED),
        (InternalError("x"), StatusCode.INTERNAL),
    ],
)
def test_errors_map_to_grpc_status_codes(error: Exception, code: StatusCode) -> None:
    assert status_code(error) == code

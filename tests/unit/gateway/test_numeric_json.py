"""numeric_json reads a KServe body to exactly what the orjson/standard-library path gives,
or declines (None) so that path decides."""

from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np
import pytest

from shardserve.errors import BadInputError
from shardserve_gateway.codecs import numeric_json
from shardserve_gateway.codecs.kserve import (
    KServeRequest,
    decode_document,
    decode_request,
    parse_json_object,
)


def _body(datatype: str, data: str, shape: str = "[2]") -> bytes:
    entry = f'{{"name":"x","shape":{shape},"datatype":"{datatype}","data":{data}}}'
    return f'{{"id":"r","inputs":[{entry}],"parameters":{{"p":[1,2]}}}}'.encode()


def _regular(raw: bytes) -> KServeRequest:
    """The path every body took before numeric_json (orjson, the stdlib on refusals)."""
    try:
        return decode_document(parse_json_object(raw), None)
    except BadInputError:
        return decode_document(parse_json_object(raw, exact=True), None)


def _numeric(raw: bytes) -> KServeRequest:
    """The path every JSON body takes now (numeric_json first)."""
    return decode_request(raw, None)


def _outcome(decode: Callable[[bytes], KServeRequest], raw: bytes) -> object:
    try:
        request = decode(raw)
    except BadInputError as exc:
        return ("error", exc.message)
    tensors = {k: (t.dtype, t.shape, t.data) for k, t in request.inputs.items()}
    return (request.id, tensors, request.outputs, request.binary_data_output)


BODIES = [
    _body("FP32", "[1.5, -2.25]"),
    _body("FP32", "[1, 2]"),
    _body("FP64", "[1e-320, 1.7976931348623157e308]"),
    _body("FP32", "[[1.0, 2.0], [3.0, 4.0]]", "[2, 2]"),
    _body("FP32", "[[1.0], [2.0, 3.0]]", "[3]"),
    _body("FP32", "[1.0, 2.0, 3.0]"),
    _body("FP32", "[1.0, true]"),
    _body("FP32", "[1.0, null]"),
    _body("FP32", '[1.0, "a"]'),
    _body("FP32", "[NaN, 1.0]"),
    _body("FP32", "[1e400, 1.0]"),
    _body("FP32", "[]", "[0]"),
    _body("FP32", "1.5", "[]"),
    _body("INT32", "[1, -2]"),
    _body("INT8", "[1, 300]"),
    _body("INT32", "[1.0, 2.0]"),
    _body("INT64", f"[0, {2**63}]"),
    _body("INT64", f"[0, {2**64}]"),
    _body("UINT64", f"[0, {2**64 - 1}]"),
    _body("UINT8", "[-1, 2]"),
    _body("BOOL", "[true, false]"),
    _body("BYTES", '["a", "\\u00e9"]'),
    _body("BYTES", '["a", "\\ud800"]'),
    _body("FP16", "[1.0, 2.0]"),
    b'{"inputs":[{"name":"x","shape":[2],"datatype":"INT32","datatype":"FP32","data":[1.5,2]}]}',
    b'{"inputs":[],"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1]}]}',
    b'{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1]},'
    b'{"name":"x","shape":[1],"datatype":"FP32","data":[2]}]}',
    b'{"inputs":[1]}',
    b'{"inputs":{"x":1}}',
    b'{"outputs":[{"name":"y","parameters":{"binary_data":true}}],'
    b'"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[3]}]}',
    b"[1, 2]",
    b'{"inputs": [',
    b"\xff",
    b'{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1]}]} x',
]


@pytest.fixture
def every_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small bodies too take the numpy path (normally only bodies of MIN_BYTES or more)."""
    monkeypatch.setattr(numeric_json, "MIN_BYTES", 0)


@pytest.mark.usefixtures("every_size")
@pytest.mark.parametrize("raw", BODIES, ids=range(len(BODIES)))
def test_every_body_decodes_exactly_as_the_regular_path_decides(raw: bytes) -> None:
    assert _outcome(_numeric, raw) == _outcome(_regular, raw)


def test_small_bodies_are_left_to_orjson() -> None:
    assert numeric_json.loads_request(_body("FP32", "[1.5, 2.5]")) is None
    big = _body("FP32", json.dumps([0.5] * 2048), "[2048]")
    assert len(big) >= numeric_json.MIN_BYTES
    doc = numeric_json.loads_request(big)
    assert doc is not None and isinstance(doc["inputs"][0]["data"], np.ndarray)


@pytest.mark.usefixtures("every_size")
def test_numeric_data_is_read_straight_into_numpy() -> None:
    doc = numeric_json.loads_request(_body("FP32", "[[1.5], [2]]", "[2, 1]"))
    assert doc is not None
    data = doc["inputs"][0]["data"]
    assert isinstance(data, np.ndarray) and data.dtype == np.float64
    assert data.tolist() == [1.5, 2.0]
    assert doc["id"] == "r" and doc["parameters"] == {"p": [1, 2]}


@pytest.mark.parametrize(
    "raw",
    [b"[1]", b'{"a":1,"a":2}', b'{"inputs":5}', b'{"x":NaN}', b"\xff", b'{"inputs":[[1]]}'],
)
@pytest.mark.usefixtures("every_size")
def test_bodies_it_cannot_be_sure_of_are_left_to_the_regular_path(raw: bytes) -> None:
    assert numeric_json.loads_request(raw) is None


def test_random_float32_bodies_match_bit_for_bit() -> None:
    values = np.random.default_rng(7).standard_normal(4096).astype(np.float32)
    values[:4] = [-0.0, np.float32(1e-45), np.finfo(np.float32).max, np.finfo(np.float32).tiny]
    as_json = json.dumps(values.astype(np.float64).tolist())
    raw = _body("FP32", as_json, "[64, 64]")
    fast = _numeric(raw).inputs["x"]
    assert fast.data == values.tobytes() == _regular(raw).inputs["x"].data

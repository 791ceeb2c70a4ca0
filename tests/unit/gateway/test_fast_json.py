"""orjson on the tensor path, with the standard library deciding wherever the two differ."""

from __future__ import annotations

import json

import numpy as np
import pytest

from shardserve.errors import BadInputError
from shardserve.wire.tensors import Tensor
from shardserve_gateway.codecs import fast_json
from shardserve_gateway.codecs.kserve import decode_request, encode_response


def _request(datatype: str, data: str) -> bytes:
    entry = f'{{"name":"x","shape":[2],"datatype":"{datatype}","data":{data}}}'
    return f'{{"inputs":[{entry}]}}'.encode()


def test_loads_falls_back_to_the_standard_library_for_nan_and_huge_numbers() -> None:
    assert np.isnan(fast_json.loads(b"[NaN]")[0])
    assert fast_json.loads(b"[1e400]") == [float("inf")]
    assert fast_json.loads(b'{"a": [1, 2.5]}') == {"a": [1, 2.5]}


def test_float32_outputs_read_back_as_the_same_float32_bits() -> None:
    values = np.random.default_rng(3).standard_normal(4096).astype(np.float32)
    values[:3] = [-0.0, np.float32(1e-45), np.finfo(np.float32).max]
    body = encode_response(
        model_name="m",
        model_version=None,
        request_id=None,
        outputs=[("y", Tensor.from_numpy(values), False)],
    ).body
    back = np.asarray(json.loads(body)["outputs"][0]["data"], dtype=np.float32)
    assert back.tobytes() == values.tobytes()


def test_non_finite_outputs_are_written_as_before() -> None:
    values = np.asarray([np.nan, np.inf, 1.5], dtype=np.float32)
    body = encode_response(
        model_name="m",
        model_version=None,
        request_id="r",
        outputs=[("y", Tensor.from_numpy(values), False)],
    ).body
    assert b'"data":[NaN,Infinity,1.5]' in body


def test_nan_inputs_are_still_accepted() -> None:
    parsed = decode_request(_request("FP32", "[NaN, -Infinity]"), None)
    array = parsed.inputs["x"].to_numpy()
    assert np.isnan(array[0]) and array[1] == -np.inf


@pytest.mark.parametrize(
    ("datatype", "data", "problem"),
    [
        ("INT64", f"[0, {2**64}]", "INT64 data holds values outside"),
        ("UINT64", f"[0, {2**70}]", "UINT64 data holds values outside"),
        ("INT64", f"[0, {-(2**63) - 1}]", "INT64 data holds values outside"),
    ],
)
def test_integers_beyond_64_bits_are_refused_with_the_exact_reason(
    datatype: str, data: str, problem: str
) -> None:
    # orjson turns these into floats; the refusal must name the range, not "not integers".
    with pytest.raises(BadInputError, match=problem):
        decode_request(_request(datatype, data), None)


def test_integer_limits_stay_exact() -> None:
    parsed = decode_request(_request("UINT64", f"[0, {2**64 - 1}]"), None)
    assert parsed.inputs["x"].to_numpy().tolist() == [0, 2**64 - 1]


@pytest.mark.parametrize(
    "data",
    [
        [1.5, -2.25, 3.0],
        [1.5, 2, True],  # ints and booleans after a float: numpy makes them float64 too
        [0.1] * 1000,
        [1.5, [2.0]],  # ragged: the general path (its leaves)
        [1.5, "x"],  # a string: the general path (a string array, refused by the cast)
        [1.5, None],  # null: the general path (an object array, refused by the cast)
        [float("nan"), 1.0],  # NaN (the stdlib parser's literal): as before
        [[1.5, 2.5], [3.5, 4.5]],
        [2, 1.5],
    ],
)
def test_the_flat_float_fast_path_gives_what_the_general_path_gives(data: list[object]) -> None:
    from shardserve_gateway.codecs.json_tensors import flatten, numpy_from_json

    fast = numpy_from_json("x", data)
    try:
        plain = np.asarray(data)  # the general path: one conversion, or the leaves
    except ValueError:
        plain = np.asarray(flatten(data))
    assert fast.dtype == plain.dtype and fast.shape == plain.shape
    np.testing.assert_array_equal(fast, plain)  # NaN equal to NaN


def test_a_bytes_string_that_is_not_valid_unicode_is_a_clear_400() -> None:
    # orjson refuses the lone surrogate, the standard library reads it: it has no UTF-8.
    with pytest.raises(BadInputError, match="not valid Unicode"):
        decode_request(_request("BYTES", '["a", "\\ud800"]'), None)


def test_leaf_types_looks_through_every_level_of_nesting() -> None:
    from shardserve_gateway.codecs.json_tensors import leaf_types

    assert leaf_types([1, [2.0, [True, "a", [None]]], {}]) == {
        int,
        float,
        bool,
        str,
        type(None),
        dict,
    }
    assert leaf_types([[1.5] * 3, [2.5]]) == {float}
    assert leaf_types([]) == set()

"""Bugs the fuzz found, each pinned by the smallest request that showed it."""

from __future__ import annotations

import json

from shardserve_gateway.codecs import numeric_json
from shardserve_gateway.codecs.kserve import decode_request


def demo_body(**extra_input_keys: object) -> bytes:
    tensor = {"name": "x", "shape": [128, 96], "datatype": "FP32", "data": [1.0] * 12288}
    return json.dumps({"inputs": [{**tensor, **extra_input_keys}]}).encode()


def test_a_key_with_nul_is_left_to_orjson_not_a_key_error() -> None:
    # Found by the stateful phase (POST /v2/models/matmul/versions/1/infer answered 500):
    # pysimdjson lists the key "a\u0000b" but cannot look it up (KeyError).
    body = demo_body(**{"a\u0000b": 1})
    assert len(body) >= numeric_json.MIN_BYTES  # (the simdjson path is taken at all)
    assert numeric_json.loads_request(body) is None
    top_level = json.dumps({"inputs": [], "\u0000": 1}).encode() + b" " * numeric_json.MIN_BYTES
    assert numeric_json.loads_request(top_level) is None


def test_the_whole_decode_of_such_a_body_succeeds_by_orjson() -> None:
    parsed = decode_request(demo_body(**{"a\u0000b": 1}), None)
    assert parsed.inputs["x"].shape == (128, 96)

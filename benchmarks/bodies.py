"""KServe v2 inference request bodies, built once per scenario and sent as they are.

JSON bodies carry ``data`` as a flat list (the form most clients send); binary bodies use
the binary tensor extension for inputs and ask for binary outputs, exactly as
``shardserve.client`` sends them (``shardserve.client.kserve.encode_request``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from shardserve.client.kserve import HEADER_LENGTH, encode_request
from shardserve.wire.tensors import DTYPE_TO_DATATYPE

JSON_HEADERS = {"Content-Type": "application/json"}


@dataclass(frozen=True)
class Body:
    """A request body with the headers it needs."""

    data: bytes
    headers: dict[str, str]
    kind: str  # "json" | "binary"


def datatype(array: np.ndarray) -> str:
    return DTYPE_TO_DATATYPE[array.dtype.str]


def json_body(inputs: dict[str, np.ndarray]) -> Body:
    """A KServe v2 JSON request: every input as ``{name, shape, datatype, data}``."""
    doc = {
        "inputs": [
            {
                "name": name,
                "shape": list(array.shape),
                "datatype": datatype(array),
                "data": array.reshape(-1).tolist(),
            }
            for name, array in inputs.items()
        ]
    }
    data = json.dumps(doc, separators=(",", ":")).encode()
    return Body(data, dict(JSON_HEADERS), "json")


def binary_body(inputs: dict[str, np.ndarray]) -> Body:
    """A KServe v2 binary-extension request asking for binary outputs."""
    types = {name: datatype(array) for name, array in inputs.items()}
    data, json_length = encode_request(inputs, types)
    headers = {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(json_length)}
    return Body(data, headers, "binary")


def make_body(kind: str, inputs: dict[str, np.ndarray]) -> Body:
    if kind == "json":
        return json_body(inputs)
    if kind == "binary":
        return binary_body(inputs)
    raise ValueError(f"unknown body kind {kind!r}")


def matmul_input(seed: int = 0) -> dict[str, np.ndarray]:
    """The demo model's input x FP32 [128, 96], fixed random values."""
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((128, 96), dtype=np.float32)}


def mlp_input(rows: int, hidden: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((rows, hidden), dtype=np.float32)}

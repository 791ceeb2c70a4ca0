"""The KServe v2 binary tensor extension, client side: request bytes and response parsing.

Request: a JSON header (every input carries ``parameters.binary_data_size`` instead of
``data``), then each input's raw bytes in input order; ``Inference-Header-Content-Length``
gives the JSON length. The request asks for binary outputs (``binary_data_output``).
Response: JSON alone, or JSON + binary blobs when ``Inference-Header-Content-Length``
is present; each output is binary (``binary_data_size``) or JSON (``data``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from shardserve.errors import BadInputError, InternalError
from shardserve.wire.tensors import DATATYPE_TO_DTYPE, pack_bytes_elements, unpack_bytes_elements

HEADER_LENGTH = "Inference-Header-Content-Length"

Buffer = bytes | memoryview


def encode_request(
    inputs: Mapping[str, np.ndarray],
    datatypes: Mapping[str, str],
    *,
    request_id: str | None = None,
    outputs: Iterable[str] | None = None,
) -> tuple[bytes, int]:
    """Return (body, json_length) of a binary-extension infer request."""
    blobs = [_tensor_bytes(name, inputs[name], datatypes[name]) for name in inputs]
    header = {
        "inputs": [
            _input_json(name, inputs[name], datatypes[name], len(blob))
            for name, blob in zip(inputs, blobs, strict=True)
        ],
        **_requested_outputs(outputs),
    }
    if request_id:
        header["id"] = request_id
    head = json.dumps(header, separators=(",", ":")).encode()
    return b"".join([head, *blobs]), len(head)


def _input_json(name: str, array: np.ndarray, datatype: str, size: int) -> dict[str, Any]:
    return {
        "name": name,
        "shape": list(array.shape),
        "datatype": datatype,
        "parameters": {"binary_data_size": size},
    }


def _requested_outputs(outputs: Iterable[str] | None) -> dict[str, Any]:
    # Without an explicit output list, all outputs come back binary (as tritonclient asks).
    if outputs is None:
        return {"parameters": {"binary_data_output": True}}
    return {"outputs": [{"name": n, "parameters": {"binary_data": True}} for n in outputs]}


def _tensor_bytes(name: str, array: np.ndarray, datatype: str) -> Buffer:
    if datatype == "BYTES":
        return pack_bytes_elements(array)
    dtype = np.dtype(DATATYPE_TO_DTYPE[datatype])
    contiguous = np.ascontiguousarray(array, dtype=dtype)
    # A byte view of a contiguous array: the join above is then the only copy.
    return contiguous.reshape(-1).data.cast("B") if contiguous.size else b""


# ---------------------------------------------------------------- response


def decode_response(body: bytes, header_length: str | None) -> dict[str, np.ndarray]:
    """Parse an infer response into {output name: array}; raise InternalError if malformed."""
    json_end = len(body) if header_length is None else _json_length(header_length, len(body))
    result = _load_json(body[:json_end])
    outputs = result.get("outputs")
    if not isinstance(outputs, list):
        raise _malformed("it has no 'outputs' list")
    blob = memoryview(body)[json_end:]
    parsed: dict[str, np.ndarray] = {}
    offset = 0
    for output in outputs:
        name, array, used = _decode_output(output, blob, offset)
        parsed[name] = array
        offset += used
    if offset != len(blob):
        raise _malformed(f"{len(blob) - offset} bytes of binary data are not claimed")
    return parsed


def _json_length(value: str, body_length: int) -> int:
    try:
        length = int(value)
    except ValueError:
        raise _malformed(f"{HEADER_LENGTH} is {value!r}") from None
    if not 0 <= length <= body_length:
        raise _malformed(f"{HEADER_LENGTH} {length} is outside the body of {body_length}")
    return length


def _load_json(raw: bytes) -> dict[str, Any]:
    try:
        result = json.loads(raw)
    except ValueError as exc:
        raise _malformed(f"its JSON does not parse: {exc}") from exc
    if not isinstance(result, dict):
        raise _malformed("its JSON is not an object")
    return result


def _decode_output(output: Any, blob: memoryview, offset: int) -> tuple[str, np.ndarray, int]:
    if not isinstance(output, dict) or not isinstance(output.get("name"), str):
        raise _malformed(f"output {output!r} has no name")
    name: str = output["name"]
    datatype, shape = _output_meta(name, output)
    size = (output.get("parameters") or {}).get("binary_data_size")
    if size is None:
        return name, _from_json(name, output.get("data"), datatype, shape), 0
    if not isinstance(size, int) or size < 0 or offset + size > len(blob):
        raise _malformed(f"output {name!r} claims {size!r} bytes, {len(blob) - offset} remain")
    return name, _from_binary(name, blob[offset : offset + size], datatype, shape), size


def _output_meta(name: str, output: dict[str, Any]) -> tuple[str, tuple[int, ...]]:
    datatype, shape = output.get("datatype"), output.get("shape")
    if datatype not in DATATYPE_TO_DTYPE:
        raise _malformed(f"output {name!r} has unknown datatype {datatype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise _malformed(f"output {name!r} has invalid shape {shape!r}")
    return datatype, tuple(shape)


def _from_binary(name: str, data: memoryview, datatype: str, shape: tuple[int, ...]) -> np.ndarray:
    if datatype == "BYTES":
        try:
            return unpack_bytes_elements(bytes(data), shape)
        except BadInputError as exc:
            raise _malformed(f"output {name!r}: {exc}") from exc
    dtype = np.dtype(DATATYPE_TO_DTYPE[datatype])
    count = int(np.prod(shape, dtype=np.int64))
    if count * dtype.itemsize != len(data):
        raise _malformed(f"output {name!r} has {len(data)} bytes for shape {list(shape)}")
    # A read-only view over the response body: no copy.
    return np.frombuffer(data, dtype=dtype).reshape(shape)


def _from_json(name: str, data: Any, datatype: str, shape: tuple[int, ...]) -> np.ndarray:
    if not isinstance(data, list):
        raise _malformed(f"output {name!r} has neither binary_data_size nor a data list")
    try:
        if datatype == "BYTES":
            flat = np.asarray(data, dtype=np.object_).reshape(-1)
            out = np.empty(len(flat), dtype=np.object_)
            out[:] = [s.encode() if isinstance(s, str) else bytes(s) for s in flat]
            return out.reshape(shape)
        return np.asarray(data, dtype=np.dtype(DATATYPE_TO_DTYPE[datatype])).reshape(shape)
    except (TypeError, ValueError) as exc:
        raise _malformed(f"output {name!r} data does not fit {datatype}{list(shape)}") from exc


def _malformed(why: str) -> InternalError:
    return InternalError(f"malformed inference response from the gateway: {why}")

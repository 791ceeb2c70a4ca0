"""KServe v2 (Open Inference Protocol) request/response bodies: JSON and binary extension.

Request: the JSON header is the whole body, or its first ``Inference-Header-Content-Length``
bytes followed by the binary tensors of the inputs that declare
``parameters.binary_data_size``, in input order (kserve-v2.md §4). Each input sets exactly
one of ``data`` and ``binary_data_size``. FP16 and BF16 inputs travel only as binary
(BF16: 2 bytes per element, the upper half of the float32 bits); as JSON outputs both are
widened to JSON numbers.

Response: ``model_name`` always, ``model_version`` only for a versioned URL, ``id`` when
the request had one, never JSON null. An output is binary when its requested
``binary_data`` says so, else when the request's ``binary_data_output`` does; binary blobs
follow the JSON in output order and ``Inference-Header-Content-Length`` gives the JSON
length (only when some blob is non-empty, as Triton does).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardserve.errors import BadInputError
from shardserve.process.integers import parse_positive_int
from shardserve.wire.tensors import (
    BYTES_DTYPE,
    DATATYPE_TO_DTYPE,
    Tensor,
    dtype_itemsize,
    unpack_bytes_elements,
)
from shardserve_gateway.codecs import fast_json, numeric_json
from shardserve_gateway.codecs.json_tensors import (
    array_from_kserve_json,
    element_count,
    parse_shape,
    to_tensor,
)
from shardserve_gateway.responses import BINARY_TYPE, JSON_TYPE

HEADER_LENGTH = "Inference-Header-Content-Length"
_ONE_SOURCE = (
    "Input must set only one of the following fields: 'data', 'binary_data_size' in 'parameters'"
)


@dataclass(frozen=True)
class RequestedOutput:
    """An output the client asked for; ``binary`` None = follow ``binary_data_output``."""

    name: str
    binary: bool | None


@dataclass(frozen=True)
class KServeRequest:
    """A decoded inference request body."""

    id: str | None
    inputs: dict[str, Tensor]
    outputs: tuple[RequestedOutput, ...] | None
    binary_data_output: bool
    timeout_ms: object


def split_body(body: bytes, header_length: str | None) -> tuple[bytes, memoryview | None]:
    """Split a body into its JSON part and binary part (None without the header)."""
    if header_length is None:
        return body, None
    n = parse_positive_int(header_length, zero_allowed=True)
    if n is None:
        raise BadInputError(f"Unable to parse {HEADER_LENGTH}: {header_length!r}")
    if n == 0:
        raise BadInputError(f"{HEADER_LENGTH}: 0 (raw binary request) is not supported")
    if n > len(body):
        raise BadInputError(f"inference header size should be in range (0, {len(body)}), got {n}")
    return body[:n], memoryview(body)[n:]


def parse_json_object(
    raw: bytes, what: str = "request body", *, exact: bool = False
) -> dict[str, Any]:
    """Parse JSON that must be an object; 400 naming the problem otherwise.

    orjson parses unless ``exact``: the standard library then parses instead (integers
    beyond 64 bits stay exact integers, where orjson would turn them into floats)."""
    try:
        value = json.loads(raw) if exact else fast_json.loads(raw)
    except RecursionError:
        raise BadInputError(f"{what} is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadInputError(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise BadInputError(f"{what} must be a JSON object")
    return value


def decode_request(body: bytes, header_length: str | None) -> KServeRequest:
    """Decode an inference request (JSON or JSON + binary tensors)."""
    header, binary = split_body(body, header_length)
    doc = numeric_json.loads_request(header)
    if doc is None:
        doc = parse_json_object(header)
    try:
        return decode_document(doc, binary)
    except BadInputError:
        # Decide refusals exactly as the standard library reads the body (a value orjson
        # widened to a float must be reported as the integer the client sent).
        return decode_document(parse_json_object(header, exact=True), binary)


def decode_document(doc: dict[str, Any], binary: memoryview | None) -> KServeRequest:
    params = _parameters(doc.get("parameters"), "request")
    if "method" in params:
        raise BadInputError(
            "select a method with the model name '<servable>:<method>', not a 'method' parameter"
        )
    request_id = doc.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise BadInputError("'id' must be a string")
    if request_id is not None and not _is_unicode(request_id):
        # A lone surrogate escape ("\ud800") parses, but the id travels on as UTF-8.
        raise BadInputError("'id' must be valid Unicode")
    reader = _BinaryReader(binary)
    inputs = _decode_inputs(doc.get("inputs"), reader)
    reader.finish()
    return KServeRequest(
        id=request_id,
        inputs=inputs,
        outputs=_decode_outputs(doc.get("outputs")),
        binary_data_output=_flag(params, "binary_data_output", "request"),
        timeout_ms=params.get("timeout_ms"),
    )


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _parameters(raw: Any, where: str) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise BadInputError(f"{where} 'parameters' must be an object")
    return raw


def _flag(params: dict[str, Any], key: str, where: str) -> bool:
    value = params.get(key, False)
    if not isinstance(value, bool):
        raise BadInputError(f"{where} parameter {key!r} must be true or false")
    return value


def _decode_inputs(raw: Any, reader: _BinaryReader) -> dict[str, Tensor]:
    if not isinstance(raw, list) or not raw:
        raise BadInputError("'inputs' must be a non-empty list")
    inputs: dict[str, Tensor] = {}
    for index, item in enumerate(raw):
        name, tensor = _decode_input(item, index, reader)
        if name in inputs:
            raise BadInputError(f"input {name!r} is given more than once")
        inputs[name] = tensor
    return inputs


def _decode_input(raw: Any, index: int, reader: _BinaryReader) -> tuple[str, Tensor]:
    if not isinstance(raw, dict):
        raise BadInputError(f"inputs[{index}] must be an object")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise BadInputError(f"inputs[{index}] needs a non-empty 'name'")
    datatype = raw.get("datatype")
    if not isinstance(datatype, str):
        raise BadInputError(f"input {name!r} needs a 'datatype'")
    shape = parse_shape(name, raw.get("shape"))
    params = _parameters(raw.get("parameters"), f"input {name!r}")
    if "shared_memory_region" in params:
        raise BadInputError(f"input {name!r}: shared memory is not supported")
    size = params.get("binary_data_size")
    if ("data" in raw) == (size is not None):
        raise BadInputError(f"input {name!r}: {_ONE_SOURCE}")
    if size is not None:
        return name, reader.take(name, datatype, shape, size)
    array = array_from_kserve_json(name, raw["data"], datatype, shape)
    return name, to_tensor(array)


class _BinaryReader:
    """Hands out the binary part of a body to the inputs that claim it, in order."""

    def __init__(self, data: memoryview | None) -> None:
        self._data = data
        self._offset = 0

    def take(self, name: str, datatype: str, shape: tuple[int, ...], size: Any) -> Tensor:
        if self._data is None:
            raise BadInputError(
                f"input {name!r}: must specify valid '{HEADER_LENGTH}' in request header and "
                "'binary_data_size' when passing inputs in binary data format"
            )
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise BadInputError(f"input {name!r}: binary_data_size must be an integer >= 0")
        left = len(self._data) - self._offset
        if size > left:
            raise BadInputError(
                f"unexpected size for input {name!r}, expecting {size} additional bytes "
                f"but only {left} remain"
            )
        chunk = bytes(self._data[self._offset : self._offset + size])
        self._offset += size
        return tensor_from_binary(name, datatype, shape, chunk)

    def finish(self) -> None:
        if self._data is not None and self._offset != len(self._data):
            extra = len(self._data) - self._offset
            raise BadInputError(f"request has {extra} bytes of binary data that no input claims")


def tensor_from_binary(name: str, datatype: str, shape: tuple[int, ...], data: bytes) -> Tensor:
    """Build a tensor from binary-extension bytes, checking the size against the shape."""
    dtype = DATATYPE_TO_DTYPE.get(datatype)
    if dtype is None:
        raise BadInputError(f"input {name!r}: unsupported datatype {datatype!r}")
    if dtype == BYTES_DTYPE:
        try:
            unpack_bytes_elements(data, shape)
        except BadInputError as exc:
            raise BadInputError(f"input {name!r}: {exc.message}") from None
        return Tensor.model_construct(dtype=dtype, shape=shape, data=data)
    needed = element_count(shape) * dtype_itemsize(dtype)
    if len(data) != needed:
        raise BadInputError(
            f"input {name!r}: binary_data_size is {len(data)} bytes, "
            f"shape {list(shape)} of {datatype} needs {needed}"
        )
    if datatype == "BOOL" and data and max(data) > 1:
        raise BadInputError(f"input {name!r}: BOOL bytes must be 0 or 1")
    return Tensor.model_construct(dtype=dtype, shape=shape, data=data)


def _decode_outputs(raw: Any) -> tuple[RequestedOutput, ...] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise BadInputError("'outputs' must be a list")
    outputs: list[RequestedOutput] = []
    for index, item in enumerate(raw):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise BadInputError(f"outputs[{index}] must be an object with a 'name'")
        name = item["name"]
        params = _parameters(item.get("parameters"), f"output {name!r}")
        if "classification" in params:
            raise BadInputError(f"output {name!r}: the classification extension is not supported")
        binary = params.get("binary_data")
        if binary is not None and not isinstance(binary, bool):
            raise BadInputError(f"output {name!r}: binary_data must be true or false")
        if any(o.name == name for o in outputs):
            raise BadInputError(f"output {name!r} is requested more than once")
        outputs.append(RequestedOutput(name, binary))
    return tuple(outputs)


@dataclass(frozen=True)
class EncodedResponse:
    """A response body with its content type and extra headers."""

    body: bytes
    content_type: str
    headers: dict[str, str]


def encode_response(
    *,
    model_name: str,
    model_version: str | None,
    request_id: str | None,
    outputs: list[tuple[str, Tensor, bool]],
) -> EncodedResponse:
    """Encode ``(name, tensor, as_binary)`` outputs as a KServe inference response."""
    doc: dict[str, Any] = {"model_name": model_name}
    if model_version is not None:
        doc["model_version"] = model_version
    if request_id:
        doc["id"] = request_id
    entries: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    finite = True
    for name, tensor, binary in outputs:
        entry: dict[str, Any] = {
            "name": name,
            "datatype": tensor.datatype,
            "shape": list(tensor.shape),
        }
        if binary:
            entry["parameters"] = {"binary_data_size": len(tensor.data)}
            blobs.append(tensor.data)
        else:
            entry["data"] = json_data(name, tensor)
            finite = finite and _finite(entry["data"])
        entries.append(entry)
    doc["outputs"] = entries
    header = fast_json.dumps(doc, finite=finite)
    if not any(blobs):
        return EncodedResponse(header, JSON_TYPE, {})
    return EncodedResponse(
        b"".join([header, *blobs]), BINARY_TYPE, {HEADER_LENGTH: str(len(header))}
    )


def _finite(data: np.ndarray | list[Any]) -> bool:
    if isinstance(data, np.ndarray):
        return fast_json.all_finite(data)
    return all(not isinstance(v, float) or math.isfinite(v) for v in data)


def json_data(name: str, tensor: Tensor) -> np.ndarray | list[Any]:
    """The flat JSON ``data`` of an output: a numeric array orjson writes from numpy (FP16
    widened to a list of JSON numbers), BYTES as a list of UTF-8 strings."""
    array = tensor.to_numpy()
    if tensor.dtype != BYTES_DTYPE:
        return fast_json.json_values(array.reshape(-1))
    try:
        return [bytes(v).decode("utf-8") for v in array.reshape(-1)]
    except UnicodeDecodeError:
        raise BadInputError(
            f"output {name!r} holds bytes that are not UTF-8; request it with binary_data"
        ) from None

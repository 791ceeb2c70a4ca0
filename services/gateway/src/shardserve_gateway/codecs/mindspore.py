"""MindSpore Serving REST bodies: ``{"instances": ...}`` in, ``{"instances": [...]}`` out.

Input values (mindspore-serving.md §3.2): JSON scalars, nested arrays, or
``{"b64": ..., "type": ..., "shape": [...]}``. MindSpore infers int -> int32 and
float -> float32. **Deviation, on purpose:** when the method's signature declares a
numeric datatype for an input, JSON numbers are cast to it whenever every value fits
(integers within range; floats into float types; floats with integral values into
integer types), so ``[[1.0, ...]]`` feeds an FP32 input and plain integers feed an INT64
one. b64 values carry their own type and are never cast. Input keys that the method
does not take are ignored, as MindSpore does.

Output values: shape ``[]`` -> JSON scalar, other shapes -> nested lists, BYTES ->
``{"b64": ...}`` (we cannot tell strings from bytes on the wire, so BYTES are always
base64), FP16 -> JSON numbers.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

import numpy as np
import simdjson

from shardserve.errors import BadInputError
from shardserve.repo.signature import ANY_DATATYPE
from shardserve.wire.protocol import InstanceResult, TensorSpec
from shardserve.wire.tensors import BYTES_DTYPE, DATATYPE_TO_DTYPE, Tensor, pack_bytes_elements
from shardserve_gateway.codecs import fast_json
from shardserve_gateway.codecs.json_tensors import cast_values, element_count, leaf_types, to_tensor

B64_KEYS = ("b64", "type", "shape")
B64_TYPES: dict[str, str] = {
    "int8": "INT8",
    "int16": "INT16",
    "int32": "INT32",
    "int64": "INT64",
    "uint8": "UINT8",
    "uint16": "UINT16",
    "uint32": "UINT32",
    "uint64": "UINT64",
    "fp16": "FP16",
    "float16": "FP16",
    "fp32": "FP32",
    "float32": "FP32",
    "fp64": "FP64",
    "float64": "FP64",
    "bool": "BOOL",
    "str": "BYTES",
    "bytes": "BYTES",
}
_DEFAULT_BY_KIND = {"b": "BOOL", "i": "INT32", "u": "INT32", "f": "FP32"}


def parse_instances(raw: bytes) -> list[dict[str, Any]]:
    """The request's instances as a list of non-empty objects (MindSpore's rules)."""
    try:
        doc = _load(raw)
    except BadInputError:
        raise
    except (ValueError, RecursionError) as exc:
        raise BadInputError(f"Illegal JSON format: {exc}") from None
    if not isinstance(doc, dict) or "instances" not in doc:
        raise BadInputError("key 'instances' expects to exist once, but actually 0 times")
    instances = doc["instances"]
    if isinstance(instances, dict):
        instances = [instances]
    if not isinstance(instances, list):
        raise BadInputError("instances no key mode is not supported")
    if not instances:
        raise BadInputError("instances value is array type, but no value")
    for instance in instances:
        if not isinstance(instance, dict):
            raise BadInputError("json array, instance is not object type")
        if not instance:
            raise BadInputError("json array, instance is object type, but no value")
    return instances


def _load(raw: bytes) -> Any:
    doc = _fast_load(raw)
    return json.loads(raw, object_pairs_hook=_no_duplicate_instances) if doc is None else doc


def _fast_load(raw: bytes) -> Any:
    """simdjson where its answer must be the standard library's, else None: 1.0 ms instead
    of 8.5 ms for the demo's 128 x 96 floats. Only with one literal "instances" and no
    \\u escape (so no key can repeat it); simdjson refuses what it reads differently
    (NaN/Infinity, numbers beyond a double or 64-bit integers, lone surrogates, deep
    nesting), and the standard library with the duplicate check then decides."""
    if raw.count(b'"instances"') != 1 or b"\\u" in raw:
        return None
    try:
        return simdjson.loads(raw)
    except (ValueError, TypeError, RuntimeError):
        return None


def _no_duplicate_instances(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    count = sum(1 for key, _ in pairs if key == "instances")
    if count > 1:
        raise BadInputError(f"key 'instances' expects to exist once, but actually {count} times")
    return dict(pairs)


def instance_tensors(instance: dict[str, Any], specs: tuple[TensorSpec, ...]) -> dict[str, Tensor]:
    """Convert one instance's values to tensors, for the inputs the method takes."""
    by_name = {s.name: s for s in specs}
    tensors: dict[str, Tensor] = {}
    for name, value in instance.items():
        if not name:
            raise BadInputError("string key is empty")
        if name in by_name:
            tensors[name] = value_to_tensor(name, value, by_name[name].datatype)
    return tensors


def value_to_tensor(name: str, value: Any, datatype: str) -> Tensor:
    """One input value (scalar, nested array or b64 object) as a tensor."""
    if value is None:
        raise BadInputError(f"input {name!r}: json value is null, it is not supported")
    if isinstance(value, dict):
        return b64_tensor(name, value)
    if isinstance(value, list) and not value:
        raise BadInputError(f"input {name!r}: json array, shape is empty")
    if isinstance(value, list) and len(_leaf_kinds(value)) > 1:
        # numpy would read true among numbers as 1, or numbers among strings as strings.
        raise BadInputError(f"input {name!r}: json array, elements type is not equal")
    try:
        array = np.asarray(value)
    except (ValueError, OverflowError):
        raise BadInputError(
            f"input {name!r}: invalid json array (ragged or out of range)"
        ) from None
    if array.dtype.kind == "U":
        return _strings_tensor(name, array)
    if array.dtype.kind not in _DEFAULT_BY_KIND:
        raise BadInputError(
            f"input {name!r}: json array, data should be number, bool, string or bytes"
        )
    target = datatype if _is_castable(datatype) else _DEFAULT_BY_KIND[array.dtype.kind]
    return to_tensor(cast_values(name, array, target, integral_floats=True))


_JSON_KINDS: dict[type, str] = {bool: "bool", int: "number", float: "number", str: "string"}


def _leaf_kinds(value: list[Any]) -> set[str]:
    """The JSON kinds among an array's leaves: bool, number, string (integers and floats
    mix freely; other kinds are left to the checks after it)."""
    return {_JSON_KINDS[t] for t in leaf_types(value) if t in _JSON_KINDS}


def _is_castable(datatype: str) -> bool:
    # BF16 is never cast from JSON (as in KServe): the signature check then names the mismatch.
    return datatype not in (ANY_DATATYPE, "BYTES", "BF16") and datatype in DATATYPE_TO_DTYPE


def _strings_tensor(name: str, array: np.ndarray) -> Tensor:
    items = np.empty(array.shape, dtype=object)
    try:
        items.reshape(-1)[:] = [s.encode("utf-8") for s in array.reshape(-1).tolist()]
    except UnicodeEncodeError:  # a lone surrogate escape ("\ud800") has no UTF-8 form
        raise BadInputError(f"input {name!r}: a string that is not valid Unicode") from None
    return Tensor(dtype=BYTES_DTYPE, shape=array.shape, data=pack_bytes_elements(items))


def b64_tensor(name: str, value: dict[str, Any]) -> Tensor:
    """A ``{"b64", "type", "shape"}`` object as a tensor (MindSpore's checks and messages)."""
    for key in value:
        if key not in B64_KEYS:
            raise BadInputError(
                f"input {name!r}: json object, key is not ['b64', 'type', 'shape'], fail key:{key}"
            )
    if "b64" not in value:
        raise BadInputError(f"input {name!r}: 'b64' should be specified only one time")
    datatype = _b64_type(name, value.get("type", "bytes"))
    shape = _b64_shape(name, value.get("shape", []))
    data = _b64_decode(name, value["b64"])
    count = element_count(shape)
    if datatype == "BYTES":
        if count != 1:
            raise BadInputError(
                f"input {name!r}: json object, only support scalar when data type is string or "
                "bytes, please check 'type' or 'shape'"
            )
        items = np.empty(shape, dtype=object)
        items.reshape(-1)[0] = data
        return Tensor(dtype=BYTES_DTYPE, shape=shape, data=pack_bytes_elements(items))
    dtype = np.dtype(DATATYPE_TO_DTYPE[datatype])
    if len(data) != count * dtype.itemsize:
        raise BadInputError(
            f"input {name!r}: size is not matched, decode base64 size:{len(data)}; Given info: "
            f"type:{value.get('type')}; type size:{dtype.itemsize}; element nums:{count}"
        )
    return Tensor.model_construct(dtype=dtype.str, shape=shape, data=data)


def _b64_type(name: str, raw: Any) -> str:
    if not isinstance(raw, str) or raw not in B64_TYPES:
        raise BadInputError(f"input {name!r}: json object, specified type:'{raw}' is illegal")
    return B64_TYPES[raw]


def _b64_shape(name: str, raw: Any) -> tuple[int, ...]:
    if not isinstance(raw, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in raw
    ):
        raise BadInputError(
            f"input {name!r}: json object, key is 'shape', array value should be unsigned integer"
        )
    return tuple(raw)


def _b64_decode(name: str, raw: Any) -> bytes:
    if not isinstance(raw, str):
        raise BadInputError(
            f"input {name!r}: get scalar data failed, type is string, but json is not string type"
        )
    try:
        return base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        raise BadInputError(f"input {name!r}: '{raw[:64]}' is illegal b64 encode string") from None


def instance_reply(result: InstanceResult, order: tuple[TensorSpec, ...]) -> dict[str, Any]:
    """One instance of the response: its outputs as JSON values, or its error."""
    if result.error is not None:
        return {"error_msg": result.error.message}
    outputs = dict(result.outputs or {})
    names = [s.name for s in order if s.name in outputs] + sorted(
        n for n in outputs if n not in {s.name for s in order}
    )
    return {name: tensor_to_json(outputs[name]) for name in names}


def tensor_to_json(tensor: Tensor) -> Any:
    """A tensor as MindSpore renders it: scalar, nested lists, or ``{"b64": ...}``.

    A numeric array stays a numpy array, which ``reply_body`` writes with orjson straight
    from numpy (20x faster than ``tolist`` + ``json.dumps`` for 128 x 16 floats); floats
    are widened to float64 first, so every value is written as the double ``tolist`` gave
    (MindSpore writes float32 outputs as doubles too), not as float32's shortest repr."""
    array = tensor.to_numpy()
    if tensor.dtype == BYTES_DTYPE:
        encoded = np.empty(array.shape, dtype=object)
        encoded.reshape(-1)[:] = [
            {"b64": base64.b64encode(bytes(v)).decode("ascii")} for v in array.reshape(-1)
        ]
        return encoded.tolist()
    if array.ndim == 0 or array.dtype.kind not in "biuf":
        return array.tolist()
    return array.astype(np.float64) if array.dtype.kind == "f" else np.ascontiguousarray(array)


def reply_body(doc: dict[str, Any]) -> bytes:
    """A MindSpore response document as JSON (numeric outputs from numpy, see above)."""
    finite = all(
        fast_json.all_finite(value)
        for instance in doc.get("instances", ())
        for value in instance.values()
        if isinstance(value, np.ndarray)
    )
    return fast_json.dumps(doc, finite=finite)

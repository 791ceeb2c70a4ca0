"""ModelInferRequest / ModelInferResponse <-> the REST codec's request and outputs.

A gRPC request is turned into the document the KServe REST codec reads
(``codecs.kserve.decode_document``), so both transports share one validation: shapes,
datatypes, sizes, duplicate names, ``parameters`` (``timeout_ms``, the refused
``method``...). Tensors in ``raw_input_contents`` (and BYTES given as ``bytes_contents``)
become the binary part, exactly like the binary tensor extension's blobs; typed
numeric ``contents`` become JSON-style ``data`` (range-checked as JSON is). Outputs are
always answered in ``raw_output_contents``, as Triton does: both tritonclient and
KServe's client read them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from shardserve.errors import BadInputError
from shardserve.wire.tensors import Tensor, pack_bytes_elements
from shardserve_gateway.codecs.kserve import KServeRequest, decode_document
from shardserve_gateway.grpcapi.protocol import grpc_service_pb2 as pb

# The typed ``contents`` field that carries each datatype (FP16/BF16 have none: raw only).
CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}
_ALL_FIELDS = frozenset(CONTENTS_FIELD.values())


def parameter_values(parameters: Mapping[str, Any]) -> dict[str, Any]:
    """A protobuf parameter map (InferParameter or ModelRepositoryParameter) as plain
    values; a parameter with no value set is refused."""
    values: dict[str, Any] = {}
    for key, parameter in parameters.items():
        choice = parameter.WhichOneof("parameter_choice")
        if choice is None:
            raise BadInputError(f"parameter {key!r} has no value")
        values[key] = getattr(parameter, choice)
    return values


def decode_infer(request: pb.ModelInferRequest) -> KServeRequest:
    """Decode a ModelInferRequest through the REST codec (400 naming the problem)."""
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise BadInputError(
            f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs "
            "(give every input's tensor there, in input order, or none)"
        )
    blobs: list[bytes] = []
    inputs = [
        _input_document(tensor, raw[index] if raw else None, blobs)
        for index, tensor in enumerate(request.inputs)
    ]
    document: dict[str, Any] = {
        "id": request.id or None,
        "inputs": inputs,
        "parameters": parameter_values(request.parameters),
    }
    if request.outputs:
        document["outputs"] = [
            {"name": o.name, "parameters": parameter_values(o.parameters)} for o in request.outputs
        ]
    binary = memoryview(b"".join(blobs)) if blobs else None
    return decode_document(document, binary)


def _input_document(
    tensor: pb.ModelInferRequest.InferInputTensor, raw: bytes | None, blobs: list[bytes]
) -> dict[str, Any]:
    name = tensor.name
    parameters = parameter_values(tensor.parameters)
    document: dict[str, Any] = {
        "name": name,
        "datatype": tensor.datatype,
        "shape": list(tensor.shape),
        "parameters": parameters,
    }
    given = [f for f in _ALL_FIELDS if getattr(tensor.contents, f)]
    if raw is not None:
        if given:
            raise BadInputError(f"input {name!r}: both contents and raw_input_contents given")
        parameters["binary_data_size"] = len(raw)
        blobs.append(raw)
        return document
    field = CONTENTS_FIELD.get(tensor.datatype)
    if field is None:
        raise BadInputError(
            f"input {name!r}: {tensor.datatype!r} tensors travel only in raw_input_contents"
        )
    if any(f != field for f in given):
        raise BadInputError(f"input {name!r}: {tensor.datatype} data goes in contents.{field}")
    values = list(getattr(tensor.contents, field))
    if tensor.datatype == "BYTES":
        blob = pack_bytes_elements(np.array(values, dtype=object))
        parameters["binary_data_size"] = len(blob)
        blobs.append(blob)
    else:
        document["data"] = values
    return document


def encode_infer(
    *,
    model_name: str,
    model_version: str,
    request_id: str | None,
    outputs: list[tuple[str, Tensor, bool]],
) -> pb.ModelInferResponse:
    """The response, every output's bytes in ``raw_output_contents``."""
    response = pb.ModelInferResponse(
        model_name=model_name, model_version=model_version, id=request_id or ""
    )
    for name, tensor, _binary in outputs:
        response.outputs.add(name=name, datatype=tensor.datatype, shape=tensor.shape)
        response.raw_output_contents.append(tensor.data)
    return response

"""Hypothesis-made calls for the gateway's gRPC API (issue 38), as bytes on the wire.

A case is one call: a method (any of ``inference.GRPCInferenceService``'s, served or
not, or one that does not exist), its message bytes (several for ModelStreamInfer),
metadata, a deadline and whether the client cancels it. The bytes are sent as they are
(no serializer), so they can be what no protobuf library would write:

- ``raw``: any bytes, to any method;
- ``mutated``: the demo's ModelInferRequest truncated, with bytes flipped, inserted or cut;
- ``wire``: a valid request with hand-made protobuf around it: wrong wire types, lengths
  past the end, 11-byte varints, invalid UTF-8 in strings, groups nested 10,000 deep,
  field number 0, a map entry without its key;
- ``poisoned``: a well-formed ModelInferRequest (or the message of another method) with
  odd names, versions, datatypes, shapes (0, -1, 2**62), contents of the wrong kind or
  size, parameters without values, unknown outputs;
- ``oversized``: a message past the gateway's limit;
- ``demo``: the well-formed demo request, so that valid calls run between the bad ones;
- ``generation`` (when the mesh serves a generation servable): Triton's decoupled
  generation request (``text_input`` and sampling values as request parameters, scalar
  inputs or a ``sampling_parameters`` JSON input) with poisoned prompts and values:
  integers past 2**63, NaN, subnormal temperatures, lone surrogates, prompts past the
  limit, wrong datatypes and shapes; mostly on ModelStreamInfer, some on ModelInfer.

Metadata mixes the right bearer token with none, a wrong one, other schemes, invalid
request ids, binary headers and more headers than grpc accepts; deadlines range from
1 us to 30 years; a call may be cancelled at once or a moment after it started, a
stream once its first answer came.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError
from hypothesis import assume
from hypothesis import strategies as st

from shardserve_gateway.grpcapi.protocol import grpc_service_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
PREFIX = f"/{SERVICE.full_name}/"
STREAM_METHOD = "ModelStreamInfer"
METHODS = tuple(method.name for method in SERVICE.methods)
UNKNOWN_PATHS = (PREFIX + "Nope", "/inference.Other/ModelInfer", "/x", PREFIX)
DEMO_MODEL = "matmul"
DEMO_SHAPE = (128, 96)
MAX_MESSAGE_BYTES = 1 << 20  # the fuzz's gateway runs with --max-body-mb 1
Metadata = tuple[tuple[str, str | bytes], ...]


@dataclass(frozen=True)
class GrpcCase:
    """One call: ``path``, its messages, metadata, deadline and cancellation."""

    label: str
    path: str
    messages: tuple[bytes, ...]
    metadata: Metadata = ()
    timeout_s: float | None = None  # None: the harness's own deadline
    cancel_after_s: float | None = None  # None: never cancelled by the client

    @property
    def streaming(self) -> bool:
        return self.path == PREFIX + STREAM_METHOD

    def describe(self) -> str:
        sizes = ",".join(str(len(m)) for m in self.messages[:4])
        keys = ",".join(key for key, _ in self.metadata[:4])
        return (
            f"{self.label} {self.path} bytes[{sizes}] metadata[{keys}] "
            f"timeout={self.timeout_s} cancel={self.cancel_after_s}"
        )


def demo_request(model: str = DEMO_MODEL) -> pb.ModelInferRequest:
    """The README's request: x = ones(128, 96) in raw_input_contents."""
    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name="x", datatype="FP32", shape=DEMO_SHAPE)
    request.raw_input_contents.append(np.ones(DEMO_SHAPE, np.float32).tobytes())
    return request


DEMO_BYTES = demo_request().SerializeToString()


# -- protobuf wire pieces ------------------------------------------------------------------


def varint(value: int) -> bytes:
    out = bytearray()
    value &= (1 << 64) - 1
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def tag(field_number: int, wire_type: int) -> bytes:
    return varint((field_number << 3) | wire_type)


def length_delimited(field_number: int, payload: bytes) -> bytes:
    return tag(field_number, 2) + varint(len(payload)) + payload


WIRE_TRICKS = {  # name -> bytes that break one rule of the wire format
    "model_name-as-varint": tag(1, 0) + varint(7),
    "inputs-as-fixed32": tag(5, 5) + b"\x01\x02\x03\x04",
    "length-past-end": tag(1, 2) + varint(1_000_000) + b"abc",
    "varint-11-bytes": tag(2, 0) + b"\xff" * 10 + b"\x01",
    "invalid-utf8-name": length_delimited(1, b"\xff\xfe\xc0"),
    "lone-surrogate-utf8": length_delimited(1, b"\xed\xa0\x80"),
    "groups-10000-deep": tag(99, 3) * 10_000 + tag(99, 4) * 10_000,
    "unclosed-group": tag(99, 3),
    "field-zero": tag(0, 0) + varint(1),
    "field-past-max": varint(((1 << 29) << 3) | 0) + varint(1),
    "wire-type-7": tag(3, 7) + b"\x00",
    "map-entry-without-key": length_delimited(4, length_delimited(2, b"")),
    "input-shape-truncated-packed": length_delimited(5, length_delimited(3, b"\x80\x80")),
    "huge-unknown-field": length_delimited(15, b"\x00" * 300_000),
    "nested-input-garbage": length_delimited(5, b"\xff" * 40),
}


# -- strategies ----------------------------------------------------------------------------

TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=20)
MODEL_NAMES = st.sampled_from(
    (DEMO_MODEL, "", "nope", f"{DEMO_MODEL}:run", f"{DEMO_MODEL}:nope", "m" * 5000, "mätmul")
) | TEXT.filter(lambda name: name.split(":")[0] != DEMO_MODEL)
VERSIONS = st.sampled_from(("", "1", "0", "-1", "2", "99999999999999999999", "one", " 1"))
DATATYPES = st.sampled_from(
    ("FP32", "FP64", "FP16", "BF16", "INT8", "INT32", "INT64", "UINT64", "BOOL", "BYTES")
    + ("fp32", "", "FP33", "STRING")
)
DIMS = st.sampled_from((-1, 0, 1, 2, 96, 128, 2**31, 2**62, -(2**63), 2**63 - 1))
SHAPES = st.just(list(DEMO_SHAPE)) | st.lists(DIMS, max_size=5)
PARAMETER_NAMES = (
    st.sampled_from(
        ("binary_data_size", "timeout_ms", "method", "binary_data_output", "classification")
        + ("sequence_id", "priority", "triton_enable_empty_final_response", "max_tokens")
    )
    | TEXT
)
CONTENT_FIELDS = (
    "bool_contents",
    "int_contents",
    "int64_contents",
    "uint_contents",
    "uint64_contents",
    "fp32_contents",
    "fp64_contents",
    "bytes_contents",
)


@st.composite
def parameter_into(draw: st.DrawFn, parameters: Any) -> None:
    """One parameter set to a value of any kind, or to none at all."""
    parameter = parameters[draw(PARAMETER_NAMES)]
    choice = draw(st.integers(0, 5))
    if choice == 0:
        parameter.bool_param = draw(st.booleans())
    elif choice == 1:
        parameter.int64_param = draw(st.integers(-(2**63), 2**63 - 1))
    elif choice == 2:
        parameter.string_param = draw(TEXT)
    elif choice == 3:
        parameter.double_param = draw(st.floats())
    elif choice == 4:
        parameter.uint64_param = draw(st.integers(0, 2**64 - 1))
    # choice 5: no value set (the InferParameter exists, empty)


@st.composite
def contents_into(draw: st.DrawFn, tensor: Any) -> None:
    """Typed contents of some kind, maybe not the tensor's own."""
    field = draw(st.sampled_from(CONTENT_FIELDS))
    count = draw(st.sampled_from((0, 1, 3, DEMO_SHAPE[0] * DEMO_SHAPE[1])))
    values: dict[str, Any] = {
        "bool_contents": st.booleans(),
        "int_contents": st.integers(-(2**31), 2**31 - 1),
        "int64_contents": st.integers(-(2**63), 2**63 - 1),
        "uint_contents": st.integers(0, 2**32 - 1),
        "uint64_contents": st.integers(0, 2**64 - 1),
        "fp32_contents": st.floats(width=32),
        "fp64_contents": st.floats(),
        "bytes_contents": st.binary(max_size=8),
    }
    getattr(tensor.contents, field).extend([draw(values[field])] * count)


@st.composite
def poisoned_infer(draw: st.DrawFn) -> bytes:
    """A well-formed ModelInferRequest whose fields are odd, wrong or missing."""
    request = pb.ModelInferRequest(
        model_name=draw(MODEL_NAMES | st.just(DEMO_MODEL)),
        model_version=draw(VERSIONS),
        id=draw(TEXT | st.just("i" * 300)),
    )
    raw_given = draw(st.booleans())
    for _ in range(draw(st.integers(0, 3))):
        tensor = request.inputs.add(name=draw(st.sampled_from(("x", "", "y")) | TEXT))
        tensor.datatype, shape = draw(DATATYPES), draw(SHAPES)
        tensor.shape.extend(shape)
        if raw_given:
            request.raw_input_contents.append(draw(raw_contents(shape)))
        elif draw(st.booleans()):
            draw(contents_into(tensor))
        for _ in range(draw(st.integers(0, 2))):
            draw(parameter_into(tensor.parameters))
    if raw_given and draw(st.integers(0, 3)) == 0:  # one entry too many
        request.raw_input_contents.append(b"\x00" * 4)
    for _ in range(draw(st.integers(0, 3))):
        draw(parameter_into(request.parameters))
    for _ in range(draw(st.integers(0, 2))):
        output = request.outputs.add(name=draw(st.sampled_from(("y", "nope", "")) | TEXT))
        if draw(st.booleans()):
            draw(parameter_into(output.parameters))
    return request.SerializeToString()


def raw_contents(shape: list[int]) -> st.SearchStrategy[bytes]:
    """The right byte count for an FP32 tensor of ``shape`` (when small), or any other."""
    elements = int(np.prod(shape)) if all(0 <= d <= 1 << 20 for d in shape) else -1
    right = st.just(b"\x00" * (4 * elements)) if 0 <= elements <= 1 << 16 else st.nothing()
    return right | st.binary(max_size=64) | st.just(np.ones(DEMO_SHAPE, np.float32).tobytes())


@st.composite
def poisoned_other(draw: st.DrawFn, method: str) -> bytes:
    """The request message of ``method`` with odd names (never one that unloads the demo:
    that is valid, and the demo must answer afterwards)."""
    message_type = getattr(pb, SERVICE.methods_by_name[method].input_type.name)
    message = message_type()
    names = {f.name for f in message_type.DESCRIPTOR.fields}
    for name in ("name", "model_name", "repository_name"):
        if name in names:
            setattr(message, name, draw(MODEL_NAMES))
    if "version" in names:
        message.version = draw(VERSIONS)
    if "ready" in names:
        message.ready = draw(st.booleans())
    if "parameters" in names and draw(st.booleans()):
        message.parameters[draw(TEXT)].string_param = draw(TEXT)
    return message.SerializeToString()


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """The demo request truncated, with bytes flipped, inserted or cut out."""
    data = bytearray(DEMO_BYTES)
    for _ in range(draw(st.integers(1, 4))):
        where = draw(st.integers(0, len(data)))
        how = draw(st.integers(0, 3))
        if how == 0:
            del data[where:]
        elif how == 1 and where < len(data):
            data[where] = draw(st.integers(0, 255))
        elif how == 2:
            data[where:where] = draw(st.binary(min_size=1, max_size=16))
        else:
            del data[where : where + draw(st.integers(1, 64))]
    return bytes(data)


@st.composite
def wire_trick(draw: st.DrawFn) -> bytes:
    trick = WIRE_TRICKS[draw(st.sampled_from(sorted(WIRE_TRICKS)))]
    before = draw(st.booleans())
    return trick + DEMO_BYTES if before else DEMO_BYTES + trick


@st.composite
def oversized(draw: st.DrawFn) -> bytes:
    extra = draw(st.sampled_from((1, 4096, MAX_MESSAGE_BYTES)))
    request = demo_request()
    request.raw_input_contents[0] = b"\x00" * (MAX_MESSAGE_BYTES + extra)
    return request.SerializeToString()


def infer_messages() -> st.SearchStrategy[tuple[str, bytes]]:
    """(sort, bytes) of one ModelInfer message."""
    return st.one_of(
        st.just(("demo", DEMO_BYTES)),
        st.binary(max_size=512).map(lambda b: ("raw", b)),
        mutated().map(lambda b: ("mutated", b)),
        wire_trick().map(lambda b: ("wire", b)),
        poisoned_infer().map(lambda b: ("poisoned", b)),
        oversized().map(lambda b: ("oversized", b)),
    )


# -- metadata, deadlines, cancellation -----------------------------------------------------


def metadata(token: str) -> st.SearchStrategy[Metadata]:
    good: Metadata = (("authorization", f"Bearer {token}"),)
    others: tuple[Metadata, ...] = (
        (),
        (("authorization", "Bearer wrong"),),
        (("authorization", "Bearer"),),
        (("authorization", f"bearer {token}"),),
        (("authorization", f"Basic {token}"),),
        (("authorization", f"Bearer  {token} "),),
        (("authorization", "Bearer " + "t" * 7000),),
        (*good, ("authorization", "Bearer wrong")),
    )
    auth = st.sampled_from((good,) * len(others) + others)  # half with the right token
    extra = st.sampled_from(
        (
            (),
            (("x-request-id", "trace-1"),),
            (("x-request-id", ""),),
            (("x-request-id", "r" * 300),),
            (("x-request-id", "has space"),),
            (("x-request-id", "tab\tinside"),),  # grpc itself refuses to send it
            (("x-request-id-bin", b"\x00\xff"),),
            (("authorization-bin", b"\x00"),),
            (("grpc-timeout", "1n"),),
            (("content-type", "text/plain"),),
            tuple((f"x-pad-{i}", "p" * 200) for i in range(60)),  # past grpc's 8 KiB
        )
    )
    return st.tuples(auth, extra).map(lambda parts: parts[0] + parts[1])


DEADLINES = st.sampled_from(
    (1e-6, 1e-4, 1e-3, 0.01, 0.1, 2.0, 3600.0, 1e6, 1e9, 30 * 365 * 86400.0)
)
CANCELS = st.sampled_from((0.0, 0.001, 0.01, 0.05))


def weighted_none(strategy: st.SearchStrategy[Any], none_share: int) -> st.SearchStrategy[Any]:
    """A value of ``strategy`` once in ``none_share`` + 1 draws; None otherwise."""
    return st.integers(0, none_share).flatmap(lambda i: strategy if i == 0 else st.none())


@st.composite
def cases(draw: st.DrawFn, token: str, generation_model: str | None = None) -> GrpcCase:
    """One call of any sort (most aimed at ModelInfer and ModelStreamInfer; a third at
    ``generation_model`` when given)."""
    sort = draw(st.integers(0, 9 if generation_model is None else 14))
    if sort >= 10:
        assert generation_model is not None
        label, path, messages = generation_case(draw, generation_model)
    elif sort < 5:
        label, message = draw(infer_messages())
        path, messages = PREFIX + "ModelInfer", (message,)
    elif sort < 7:
        parts = draw(st.lists(infer_messages(), min_size=0, max_size=4))
        label = "stream:" + "+".join(p[0] for p in parts)
        path, messages = PREFIX + STREAM_METHOD, tuple(p[1] for p in parts)
    elif sort < 9:
        method = draw(
            st.sampled_from([m for m in METHODS if m not in ("ModelInfer", STREAM_METHOD)])
        )
        raw = draw(st.booleans())
        message = draw(st.binary(max_size=256) if raw else poisoned_other(method))
        label = f"other-method:{method}:{'raw' if raw else 'poisoned'}"
        path, messages = PREFIX + method, (message,)
    else:
        label, path = "unknown-method", draw(st.sampled_from(UNKNOWN_PATHS))
        messages = (draw(st.sampled_from((DEMO_BYTES, b""))),)
    assume(not unloads_demo(path, messages))
    return GrpcCase(
        label=label,
        path=path,
        messages=messages,
        metadata=draw(metadata(token)),
        timeout_s=draw(weighted_none(DEADLINES, 4)),
        cancel_after_s=draw(weighted_none(CANCELS, 6)),
    )


# -- generation requests -------------------------------------------------------------------

GENERATION_VALUES = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")
GENERATION_VALUES += ("stop_token_ids", "ignore_eos", "triton_enable_empty_final_response")
PROMPTS = st.sampled_from(
    ("Hello", "", "\x00", "\u00e9t\u00e9", "hello world " * 20_000, "x" * 900_000)
) | st.text(max_size=40)
PROMPT_BYTES = PROMPTS.map(lambda text: text.encode("utf-8", "surrogatepass")) | st.sampled_from(
    (b"\xff\xfe", b"\xed\xa0\x80", b"a\x80")  # not UTF-8; a lone surrogate's bytes
)
POISON_JSON = st.sampled_from(
    ('{"max_tokens": 4}', '{"temperature": 1e-310, "top_p": 0.9}')
    + ('{"top_k": 18446744073709551616}', '{"max_tokens": NaN}', '{"stop": "\\ud800"}')
    + ("[1, 2]", "{", '"x"', "[" * 50_000)
)


@st.composite
def generation_value_into(draw: st.DrawFn, parameters: Any, name: str) -> None:
    """``name`` set to a value of a kind a client might send, poison included."""
    parameter = parameters[name]
    choice = draw(st.integers(0, 4))
    if choice == 0:
        parameter.int64_param = draw(st.sampled_from((4, 0, -1, 2**31, 2**63 - 1, -(2**63))))
    elif choice == 1:
        values = (0.0, 0.5, 1.0, 1e-310, 5e-324, float("nan"), float("inf"), -1.0, 1e308)
        parameter.double_param = draw(st.sampled_from(values))
    elif choice == 2:
        parameter.string_param = draw(st.sampled_from(("\n", "Hello", "", "[1, 2]")) | TEXT)
    elif choice == 3:
        parameter.bool_param = draw(st.booleans())
    else:
        parameter.uint64_param = draw(st.sampled_from((4, 2**64 - 1)))


@st.composite
def generation_request(draw: st.DrawFn, model: str) -> bytes:
    """A generation request for ``model``: ``text_input`` plus sampling values, some of
    them poisoned (a prompt of the wrong kind, a value no sampler can use)."""
    request = pb.ModelInferRequest(model_name=draw(st.just(model) | MODEL_NAMES), id=draw(TEXT))
    text = request.inputs.add(name="text_input", datatype="BYTES")
    text.datatype = draw(st.just("BYTES") | DATATYPES)
    prompts = draw(st.lists(PROMPT_BYTES, min_size=1, max_size=2))
    text.shape.extend(draw(st.just([len(prompts)]) | SHAPES))
    text.contents.bytes_contents.extend(prompts)
    request.parameters["max_tokens"].int64_param = 4
    for name in draw(st.lists(st.sampled_from(GENERATION_VALUES), max_size=3)):
        draw(generation_value_into(request.parameters, name))
    if draw(st.integers(0, 4)) == 0:  # vLLM's way: the values as a JSON input
        sampling = request.inputs.add(name="sampling_parameters", datatype="BYTES", shape=[1])
        sampling.contents.bytes_contents.append(draw(POISON_JSON).encode())
    if draw(st.integers(0, 4)) == 0:  # Triton's way: a value as a scalar input
        scalar = request.inputs.add(name=draw(st.sampled_from(GENERATION_VALUES)), shape=[1])
        scalar.datatype = draw(DATATYPES)
        draw(contents_into(scalar))
    return request.SerializeToString()


def generation_case(draw: st.DrawFn, model: str) -> tuple[str, str, tuple[bytes, ...]]:
    """(label, path, messages) of generation requests: a stream of one to three (the
    decoupled convention), or one on ModelInfer."""
    messages = tuple(draw(st.lists(generation_request(model), min_size=1, max_size=3)))
    if draw(st.integers(0, 4)) == 0:
        return "generation-unary", PREFIX + "ModelInfer", messages[:1]
    return "generation-stream", PREFIX + STREAM_METHOD, messages


def unloads_demo(path: str, messages: tuple[bytes, ...]) -> bool:
    """Whether the call would unload the demo model (valid: never sent)."""
    if path != PREFIX + "RepositoryModelUnload":
        return False
    try:
        request = pb.RepositoryModelUnloadRequest.FromString(messages[0])
    except DecodeError:
        return False
    return request.model_name.split(":")[0].strip() == DEMO_MODEL

"""The gRPC fuzz's own parts, pure: the oracle, the cases, the tally."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import cast

import grpc
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from tests.fuzz.grpc_cases import (
    DEMO_BYTES,
    PREFIX,
    STREAM_METHOD,
    WIRE_TRICKS,
    GrpcCase,
    cases,
    unloads_demo,
)
from tests.fuzz.grpc_fuzz import (
    CLIENT_CANCELLED,
    NO_ANSWER,
    GrpcFuzzResult,
    GrpcTally,
    Sender,
    judge,
)
from tests.fuzz.run import FuzzRun

from shardserve_gateway.grpcapi.protocol import grpc_service_pb2 as pb
from shardserve_gateway.grpcapi.streaming import INTERNAL_MESSAGE


class Status(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, trailing: tuple[tuple[str, str], ...] = ()):
        self._code, self._trailing = code, trailing

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "details"

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._trailing


def case(**changes: object) -> GrpcCase:
    fields: dict[str, object] = {"label": "t", "path": PREFIX + "ModelInfer"}
    fields["messages"] = (DEMO_BYTES,)
    return GrpcCase(**(fields | changes))  # type: ignore[arg-type]


Code = grpc.StatusCode
RETRY = (("retry-after", "1"),)


@pytest.mark.parametrize(
    ("call", "status", "outcome", "wrong"),
    [
        (case(), None, "OK", False),
        (case(), Status(Code.INVALID_ARGUMENT), "INVALID_ARGUMENT", False),
        (case(), Status(Code.INTERNAL), "INTERNAL", True),
        (case(), Status(Code.UNKNOWN), "UNKNOWN", True),
        (case(), Status(Code.UNAVAILABLE), "UNAVAILABLE", True),
        (case(), Status(Code.UNAVAILABLE, RETRY), "UNAVAILABLE", False),
        (case(), Status(Code.DEADLINE_EXCEEDED), NO_ANSWER, True),
        (case(timeout_s=0.001), Status(Code.DEADLINE_EXCEEDED), "DEADLINE_EXCEEDED", False),
        (case(), Status(Code.CANCELLED), "CANCELLED", True),
        (case(cancel_after_s=0.0), Status(Code.CANCELLED), CLIENT_CANCELLED, False),
    ],
)  # fmt: skip
def test_the_oracle_fails_server_errors_broken_calls_and_silence(
    call: GrpcCase, status: grpc.RpcError | None, outcome: str, wrong: bool
) -> None:
    got, problem = judge(call, status, 1)
    assert got == outcome
    assert (problem is not None) == wrong


def test_a_stream_that_ends_ok_must_answer_every_request() -> None:
    stream = case(path=PREFIX + STREAM_METHOD, messages=(DEMO_BYTES, DEMO_BYTES))
    assert judge(stream, None, 2) == ("OK", None)
    assert judge(stream, None, 1)[1] == "1 answers to 2 requests"


def test_a_tally_and_a_run_fail_on_one_wrong_call() -> None:
    tally = GrpcTally()
    tally.record(case(), "OK", None)
    assert tally.passed
    run = FuzzRun(grpc=GrpcFuzzResult(tally, True, True, True), demo_ok=True)
    assert run.passed  # (--http 0 --amqp 0 --grpc N)
    tally.record(case(label="raw"), "INTERNAL", "boom")
    assert not tally.passed and not run.passed
    assert tally.failures[0].startswith("INTERNAL: boom: raw ")
    assert not GrpcFuzzResult(GrpcTally(Counter(OK=1)), True, False, True).passed  # in flight


def test_cases_are_of_every_sort_and_never_unload_the_demo() -> None:
    sorts: Counter[str] = Counter()

    @settings(
        max_examples=400, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
    )
    @given(call=cases("token"))
    def collect(call: GrpcCase) -> None:
        sorts[call.label.split(":")[0].split("+")[0]] += 1
        sorts["cancelled" if call.cancel_after_s is not None else "-"] += 1
        sorts["deadline" if call.timeout_s is not None else "-"] += 1
        sorts["no-token" if ("authorization", "Bearer token") not in call.metadata else "-"] += 1
        assert not unloads_demo(call.path, call.messages)

    collect()
    expected = {"demo", "raw", "mutated", "wire", "poisoned", "oversized", "stream"}
    assert expected | {
        "other-method",
        "unknown-method",
        "cancelled",
        "deadline",
        "no-token",
    } <= set(sorts)


def test_an_unload_of_the_demo_is_recognised() -> None:
    path = PREFIX + "RepositoryModelUnload"
    unload = pb.RepositoryModelUnloadRequest(model_name="matmul").SerializeToString()
    assert unloads_demo(path, (unload,))
    method = pb.RepositoryModelUnloadRequest(model_name=" matmul:predict").SerializeToString()
    assert unloads_demo(path, (method,))
    assert not unloads_demo(
        path, (pb.RepositoryModelUnloadRequest(model_name="x").SerializeToString(),)
    )
    assert not unloads_demo(PREFIX + "RepositoryModelLoad", (unload,))


def test_wire_tricks_break_the_format_where_they_say() -> None:
    for name in ("invalid-utf8-name", "length-past-end", "varint-11-bytes", "unclosed-group"):
        with pytest.raises(DecodeError):
            pb.ModelInferRequest.FromString(DEMO_BYTES + WIRE_TRICKS[name])
    # An unknown field is skipped, as protobuf says: the request stays the demo's.
    kept = pb.ModelInferRequest.FromString(DEMO_BYTES + WIRE_TRICKS["huge-unknown-field"])
    assert kept.model_name == "matmul"


def test_generation_cases_reach_the_servable_on_both_methods_with_poison() -> None:
    seen: Counter[str] = Counter()

    @settings(
        max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
    )
    @given(call=cases("token", "llama"))
    def collect(call: GrpcCase) -> None:
        if "generation" not in call.label:
            return
        seen[call.label] += 1
        for raw in call.messages:
            request = pb.ModelInferRequest.FromString(raw)
            seen["to-llama"] += request.model_name == "llama"
            seen["text_input"] += any(t.name == "text_input" for t in request.inputs)
            for value in request.parameters.values():
                kind = value.WhichOneof("parameter_choice")
                poisoned = kind == "double_param" and not 1e-300 < abs(value.double_param) < 1e300
                seen["poisoned-number"] += poisoned
            seen["json-input"] += any(t.name == "sampling_parameters" for t in request.inputs)

    collect()
    assert seen["generation-stream"] > seen["generation-unary"] > 0
    assert min(seen["to-llama"], seen["text_input"], seen["poisoned-number"]) > 0
    assert seen["json-input"] > 0


def test_a_stream_answering_with_the_internal_error_fails_the_call() -> None:
    internal = pb.ModelStreamInferResponse(error_message=INTERNAL_MESSAGE).SerializeToString()

    class Channel:
        """A channel whose every stream answers once, with the gateway's internal error."""

        def stream_stream(self, path: str) -> Callable[..., Iterator[bytes]]:
            return lambda *args, **kwargs: iter([internal])

    tally = GrpcTally()
    Sender(cast(grpc.Channel, Channel())).send(
        case(path=PREFIX + STREAM_METHOD, messages=(DEMO_BYTES,)), tally
    )
    assert tally.statuses["INTERNAL"] == 1 and not tally.passed

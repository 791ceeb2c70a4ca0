"""Fuzzing of the gateway's gRPC API (issue 38): ``grpc_cases`` calls sent as raw bytes
through a grpc channel (no serializer), each judged by the status it ends with.

The calls go to a gateway of their own, joined to the fuzz's mesh, with a bearer token
(so that auth is fuzzed; the mesh's own gateway serves the HTTP fuzz without one) and a
1 MiB message limit (so that oversized messages are cheap). A call passes when it ends
with a status that is not a server's failure within ``HARNESS_TIMEOUT_S``:

- INTERNAL, UNKNOWN and DATA_LOSS are failures, always;
- UNAVAILABLE is one unless the gateway said when to retry (``retry-after``): without
  it, the connection broke;
- DEADLINE_EXCEEDED is one for a call whose deadline the fuzz did not choose, and
  CANCELLED for a call it did not cancel;
- a stream that ends OK must have answered every request it was sent, once.

Afterwards the gateway must still be the same process, its in-flight count back to the
one request that reads it, and the demo must answer -48 over gRPC.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import hypothesis
import numpy as np
from hypothesis import given
from tests.fuzz.grpc_cases import DEMO_BYTES, PREFIX, GrpcCase, cases
from tests.fuzz.http_fuzz import _settings as fuzz_settings
from tests.fuzz.http_fuzz import run_in_chunks
from tests.fuzz.tally import EXAMPLES_KEPT

from shardserve.ops.child_mesh import READY_PATH, LoggedProcess, free_port
from shardserve_gateway.grpcapi.protocol import grpc_service_pb2 as pb
from shardserve_gateway.grpcapi.streaming import INTERNAL_MESSAGE

HARNESS_TIMEOUT_S = 60.0
TOKEN = "grpc-fuzz-token"
NEVER_RIGHT = frozenset(
    {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS}
)
NO_ANSWER = "NO_ANSWER"
CLIENT_REFUSED_METADATA = "Invalid metadata"  # grpc's own status for a header it won't send
CLIENT_CANCELLED = "CLIENT_CANCELLED"
INFLIGHT_METRIC = "shardserve_gateway_inflight_requests"


@dataclass
class GrpcTally:
    """Calls by the status they ended with (or NO_ANSWER, CLIENT_CANCELLED)."""

    source: str = "grpc"
    statuses: Counter[str] = field(default_factory=Counter)
    by_label: Counter[str] = field(default_factory=Counter)
    refused_by_client: int = 0  # calls grpc would not send (metadata it refuses)
    wrong: int = 0
    failures: list[str] = field(default_factory=list)

    @property
    def sent(self) -> int:
        return sum(self.statuses.values())

    @property
    def passed(self) -> bool:
        return self.sent > 0 and self.wrong == 0

    def record(self, case: GrpcCase, outcome: str, problem: str | None) -> None:
        self.statuses[outcome] += 1
        self.by_label[case.label.split(":")[0].split("+")[0]] += 1
        if problem is not None:
            self.wrong += 1
            if len(self.failures) < EXAMPLES_KEPT:
                self.failures.append(f"{outcome}: {problem}: {case.describe()}")

    def as_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "sent": self.sent,
            "statuses": dict(sorted(self.statuses.items())),
            "by_sort": dict(sorted(self.by_label.items())),
            "refused_by_client": self.refused_by_client,
            "wrong": self.wrong,
            "failures": self.failures,
            "passed": self.passed,
        }

    def summary(self) -> str:
        statuses = " ".join(f"{k}:{v}" for k, v in sorted(self.statuses.items()))
        return (
            f"grpc: sent {self.sent} (client refused {self.refused_by_client}); "
            f"statuses {statuses}; wrong {self.wrong}"
        )


def judge(case: GrpcCase, error: grpc.RpcError | None, answers: int) -> tuple[str, str | None]:
    """(outcome, the problem or None) of a call that ended with ``error`` (None: OK)."""
    if error is None:
        if case.streaming and answers != len(case.messages):
            return "OK", f"{answers} answers to {len(case.messages)} requests"
        return "OK", None
    code = error.code()
    if code in NEVER_RIGHT:
        return code.name, f"{error.details()!r}"
    if code == grpc.StatusCode.UNAVAILABLE and "retry-after" not in dict(
        error.trailing_metadata() or ()
    ):
        return code.name, f"no retry-after: {error.details()!r}"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED and case.timeout_s is None:
        return NO_ANSWER, f"no answer within {HARNESS_TIMEOUT_S:.0f} s"
    if code == grpc.StatusCode.CANCELLED:
        if case.cancel_after_s is None:
            return code.name, f"cancelled, not by the client: {error.details()!r}"
        return CLIENT_CANCELLED, None
    return code.name, None


class Sender:
    """Sends cases over one channel (grpc reconnects it when a case broke it)."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.channel = channel
        self._pause = threading.Event()  # never set: waits the cancel delay out

    def close(self) -> None:
        self.channel.close()

    def send(self, case: GrpcCase, tally: GrpcTally) -> None:
        timeout = HARNESS_TIMEOUT_S if case.timeout_s is None else case.timeout_s
        try:
            if case.streaming:
                error, answers = self._stream(case, timeout)
            else:
                error, answers = self._unary(case, timeout)
        except ValueError:
            tally.refused_by_client += 1  # e.g. metadata grpc will not put on the wire
            return
        if error is not None and error.details() == CLIENT_REFUSED_METADATA:
            tally.refused_by_client += 1  # (grpc checks header values before sending)
            return
        tally.record(case, *judge(case, error, answers))

    def _unary(self, case: GrpcCase, timeout: float) -> tuple[grpc.RpcError | None, int]:
        method = self.channel.unary_unary(case.path)
        future = method.future(case.messages[0], metadata=case.metadata, timeout=timeout)
        if case.cancel_after_s is not None:
            self._pause.wait(case.cancel_after_s)
            future.cancel()
        try:
            future.result(timeout=HARNESS_TIMEOUT_S + 5)
        except grpc.FutureCancelledError:
            return _cancelled(), 0
        except grpc.FutureTimeoutError:
            future.cancel()
            return _no_answer(), 0
        except grpc.RpcError as error:
            return error, 0
        return None, 1

    def _stream(self, case: GrpcCase, timeout: float) -> tuple[grpc.RpcError | None, int]:
        method = self.channel.stream_stream(case.path)
        responses = method(iter(case.messages), metadata=case.metadata, timeout=timeout)
        answers = 0
        try:
            for raw in responses:
                response = pb.ModelStreamInferResponse.FromString(raw)
                if response.error_message == INTERNAL_MESSAGE:
                    return _Ended(grpc.StatusCode.INTERNAL, "an internal error answered"), answers
                answers += _finals(response)
                if case.cancel_after_s is not None:
                    responses.cancel()  # mid-way: once the first answer came
        except grpc.RpcError as error:
            return error, answers
        return None, answers


def _finals(response: pb.ModelStreamInferResponse) -> int:
    """1 for a response that ends its request (every non-generation answer is final)."""
    final = response.infer_response.parameters.get("triton_final_response")
    return 1 if response.error_message or final is None or final.bool_param else 0


class _Ended(grpc.RpcError):
    """An outcome the client saw without an error status: it cancelled, gave up waiting,
    or a stream answered one request with the gateway's internal error."""

    def __init__(self, code: grpc.StatusCode, details: str = "ended by the client") -> None:
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[()]:
        return ()


def _cancelled() -> grpc.RpcError:
    return _Ended(grpc.StatusCode.CANCELLED)


def _no_answer() -> grpc.RpcError:
    return _Ended(grpc.StatusCode.DEADLINE_EXCEEDED)


def fuzz_cases(
    address: str,
    tally: GrpcTally,
    count: int,
    seed: int = 0,
    generation_model: str | None = None,
) -> None:
    """``count`` Hypothesis-made cases sent to ``address`` (a third of them generation
    requests for ``generation_model`` when given)."""
    sender = Sender(
        grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", -1)])
    )

    def run(examples: int, chunk: int) -> None:
        @fuzz_settings(examples, seed + chunk)
        @given(case=cases(TOKEN, generation_model))
        def one(case: GrpcCase) -> None:
            sender.send(case, tally)

        one()

    try:
        run_in_chunks(count, lambda: tally.sent + tally.refused_by_client, run)
    except hypothesis.errors.Unsatisfiable:
        pass
    finally:
        sender.close()


# -- the gateway under test ----------------------------------------------------------------


@dataclass
class FuzzedGateway:
    """A gateway of its own on the mesh's broker: bearer token, 1 MiB messages."""

    amqp_url: str
    log_path: Path
    http_port: int = field(default_factory=free_port)
    grpc_port: int = field(default_factory=free_port)
    process: LoggedProcess | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def start(self) -> None:
        argv = [sys.executable, "-m", "shardserve_gateway", "--host", "127.0.0.1"]
        argv += ["--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port)]
        argv += ["--max-body-mb", "1"]
        env = {
            **os.environ,
            "SHARDSERVE_AMQP_URL": self.amqp_url,
            "SHARDSERVE_GATEWAY_TOKENS": TOKEN,
            "PYTHONUNBUFFERED": "1",
        }
        self.process = LoggedProcess(argv, env, self.log_path)
        self.process.start()
        self.process.wait_http_ready(self.http_url + READY_PATH, 120.0)

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop(30.0)

    def alive(self) -> bool:
        return self.process is not None and self.process.alive()

    def inflight(self) -> int | None:
        try:
            with urllib.request.urlopen(self.http_url + "/metrics", timeout=10) as response:
                text = response.read().decode()
        except OSError:
            return None
        for line in text.splitlines():
            if line.startswith(INFLIGHT_METRIC + " "):
                return int(float(line.split()[1]))
        return None

    def settled(self, within_s: float = 30.0) -> bool:
        """Whether only the request reading the gauge is in flight (within ``within_s``:
        a cancelled call's handler may still be unwinding)."""
        end = time.monotonic() + within_s
        while time.monotonic() < end:
            if self.inflight() == 1:
                return True
            threading.Event().wait(0.2)
        return False


def demo_over_grpc(address: str) -> bool:
    """The demo ModelInfer answers y = -48 everywhere."""
    with grpc.insecure_channel(address) as channel:
        method = channel.unary_unary(PREFIX + "ModelInfer")
        try:
            raw = method(DEMO_BYTES, metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=60)
        except grpc.RpcError:
            return False
    response = pb.ModelInferResponse.FromString(raw)
    y = np.frombuffer(response.raw_output_contents[0], np.float32)
    return y.size == 128 * 16 and bool(np.all(y == -48.0))


@dataclass
class GrpcFuzzResult:
    tally: GrpcTally
    same_process: bool = False
    settled: bool = False
    demo_ok: bool = False

    @property
    def passed(self) -> bool:
        return self.tally.passed and self.same_process and self.settled and self.demo_ok

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.tally.as_dict(),
            "gateway_same_process": self.same_process,
            "inflight_settled": self.settled,
            "demo_answers_-48": self.demo_ok,
            "passed": self.passed,
        }

    def lines(self) -> Iterator[str]:
        yield self.tally.summary()
        yield from (f"  {failure}" for failure in self.tally.failures)
        yield (
            f"grpc gateway: same process {self.same_process}; in flight settled "
            f"{self.settled}; demo -48 over gRPC: {self.demo_ok}"
        )


def run_grpc_fuzz(
    amqp_url: str, workdir: Path, count: int, generation_model: str | None = None
) -> GrpcFuzzResult:
    """Start the fuzzed gateway on the mesh at ``amqp_url``, send ``count`` cases (some
    to ``generation_model`` when the mesh serves one), check."""
    gateway = FuzzedGateway(amqp_url, workdir / "grpc-gateway.log")
    result = GrpcFuzzResult(GrpcTally())
    try:
        gateway.start()
        fuzz_cases(gateway.address, result.tally, count, generation_model=generation_model)
        result.settled = gateway.settled()
        result.demo_ok = demo_over_grpc(gateway.address)
        # (not supervised: a crash would leave it dead, not restarted)
        result.same_process = gateway.alive()
    finally:
        gateway.stop()
    return result

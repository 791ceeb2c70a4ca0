"""The gateway's gRPC API on the demo mesh (MatMul over 8 ranks), driven by tritonclient.grpc
and KServe's ``InferenceGRPCClient`` unchanged (in a process of its own: see
``kserve_client_calls.py``), and by raw stubs of our generated code.

One mesh with a bearer token and a 1 MiB message limit: every call sends the token, one
test leaves it out; the limit makes an oversized request cheap to send.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

from shardserve.ops.child_mesh import LocalMesh, free_port
from shardserve.tools.export.matmul import reference_model
from shardserve_gateway.grpcapi.protocol import grpc_service_pb2 as pb
from shardserve_gateway.grpcapi.protocol import grpc_service_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration

TOKEN = "grpc-test-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
KSERVE_CALLS = Path(__file__).resolve().parent / "kserve_client_calls.py"
X = np.ones((128, 96), np.float32)


@pytest.fixture(scope="module")
def mesh(isolated_amqp_url: str, export_repo: Any, tmp_path_factory: Any) -> Iterator[LocalMesh]:
    repo = export_repo(
        "matmul", tmp_path_factory.mktemp("repo"), "--rank-size", "8", "--strategy", "column"
    )
    env = {"SHARDSERVE_GATEWAY_TOKENS": TOKEN, "SHARDSERVE_GATEWAY_MAX_BODY_MB": "1"}
    log = tmp_path_factory.mktemp("mesh") / "mesh.log"
    mesh = LocalMesh(repo, isolated_amqp_url, free_port(), log, (), env, grpc_port=free_port())
    mesh.start()
    try:
        mesh.wait_ready()
        yield mesh
    finally:
        assert mesh.stop() == 0, mesh.log_tail()


@pytest.fixture(scope="module")
def client(mesh: LocalMesh) -> Iterator[triton.InferenceServerClient]:
    with triton.InferenceServerClient(f"127.0.0.1:{mesh.grpc_port}") as client:
        yield client


@pytest.fixture(scope="module")
def stub(mesh: LocalMesh) -> Iterator[pb_grpc.GRPCInferenceServiceStub]:
    with grpc.insecure_channel(f"127.0.0.1:{mesh.grpc_port}") as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


def unsliced(x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(
        reference_model().SerializeToString(), providers=["CPUExecutionProvider"]
    )
    return session.run(None, {"x": x})[0]  # type: ignore[no-any-return]


def matmul_inputs(x: np.ndarray) -> list[triton.InferInput]:
    inp = triton.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return [inp]


def test_tritonclient_infer_on_the_demo_gives_minus_48(
    client: triton.InferenceServerClient,
) -> None:
    result = client.infer("matmul", matmul_inputs(X), headers=AUTH)
    y = result.as_numpy("y")
    assert y is not None and y.shape == (128, 16) and y.dtype == np.float32
    assert np.all(y == -48.0)
    assert result.get_response().model_name == "matmul"


def test_many_requests_each_get_their_own_answer(client: triton.InferenceServerClient) -> None:
    """Eight calls in flight at once (async_infer): each answer is its own input's."""
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal((128, 96)).astype(np.float32) for _ in range(8)]
    answers: queue.Queue[tuple[np.ndarray, Any, Any]] = queue.Queue()
    for x in xs:
        client.async_infer(
            "matmul",
            matmul_inputs(x),
            lambda result, error, x=x: answers.put((x, result, error)),
            headers=AUTH,
        )
    for _ in xs:
        x, result, error = answers.get(timeout=120)
        assert error is None, error
        assert np.max(np.abs(result.as_numpy("y") - unsliced(x))) <= 1e-5


def test_health_and_metadata(client: triton.InferenceServerClient) -> None:
    assert client.is_server_live(headers=AUTH) and client.is_server_ready(headers=AUTH)
    assert client.is_model_ready("matmul", headers=AUTH)
    assert not client.is_model_ready("nope", headers=AUTH)
    metadata = client.get_model_metadata("matmul", headers=AUTH, as_json=True)
    assert metadata["inputs"] == [{"name": "x", "datatype": "FP32", "shape": ["128", "96"]}]
    assert client.get_server_metadata(headers=AUTH).name == "shardserve"
    index = client.get_model_repository_index(headers=AUTH, as_json=True)
    assert [m["state"] for m in index["models"]] == ["READY"]


def test_raw_stub_kserve_subset_with_typed_contents(stub: pb_grpc.GRPCInferenceServiceStub) -> None:
    request = pb.ModelInferRequest(model_name="matmul", id="req-7")
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[128, 96])
    tensor.contents.fp32_contents.extend([1.0] * (128 * 96))
    response = stub.ModelInfer(request, metadata=tuple(AUTH.items()))
    assert response.id == "req-7"
    (out,) = response.outputs
    y = np.frombuffer(response.raw_output_contents[0], np.float32).reshape(out.shape)
    assert np.all(y == -48.0)


@pytest.mark.parametrize(
    ("change", "code", "words"),
    [
        ({"model_name": "nope"}, grpc.StatusCode.NOT_FOUND, "nope"),
        ({"model_version": "9"}, grpc.StatusCode.NOT_FOUND, "version 9"),
        ({"model_version": "x"}, grpc.StatusCode.INVALID_ARGUMENT, "version"),
        ({"shape": [128, 95]}, grpc.StatusCode.INVALID_ARGUMENT, "95"),
        ({"datatype": "INT32"}, grpc.StatusCode.INVALID_ARGUMENT, "INT32"),
        ({"raw": b"\x00" * 12}, grpc.StatusCode.INVALID_ARGUMENT, "x"),
    ],
)
def test_bad_requests_get_their_status(
    stub: pb_grpc.GRPCInferenceServiceStub,
    change: dict[str, Any],
    code: grpc.StatusCode,
    words: str,
) -> None:
    request = pb.ModelInferRequest(
        model_name=change.get("model_name", "matmul"), model_version=change.get("model_version", "")
    )
    request.inputs.add(
        name="x", datatype=change.get("datatype", "FP32"), shape=change.get("shape", [128, 96])
    )
    request.raw_input_contents.append(change.get("raw", X.tobytes()))
    with pytest.raises(grpc.RpcError) as raised:
        stub.ModelInfer(request, metadata=tuple(AUTH.items()))
    assert raised.value.code() == code, raised.value.details()
    assert words in raised.value.details()
    trailing = dict(raised.value.trailing_metadata() or ())
    assert trailing.get("x-request-id")


def test_request_id_comes_back_in_metadata(stub: pb_grpc.GRPCInferenceServiceStub) -> None:
    request = pb.ModelInferRequest(model_name="matmul")
    request.inputs.add(name="x", datatype="FP32", shape=[128, 96])
    request.raw_input_contents.append(X.tobytes())
    metadata = (*AUTH.items(), ("x-request-id", "trace-42"))
    _, call = stub.ModelInfer.with_call(request, metadata=metadata)
    assert dict(call.trailing_metadata())["x-request-id"] == "trace-42"


def test_without_a_token_the_call_is_unauthenticated(
    client: triton.InferenceServerClient,
) -> None:
    with pytest.raises(InferenceServerException) as raised:
        client.infer("matmul", matmul_inputs(X))
    assert "UNAUTHENTICATED" in str(raised.value.status())
    with pytest.raises(InferenceServerException) as wrong:
        client.infer("matmul", matmul_inputs(X), headers={"authorization": "Bearer wrong"})
    assert "UNAUTHENTICATED" in str(wrong.value.status())
    assert client.is_server_live()  # health stays open (--open-health)


def test_a_message_above_the_body_limit_is_resource_exhausted(
    client: triton.InferenceServerClient,
) -> None:
    big = np.ones((1024, 512), np.float32)  # 2 MiB, the limit is 1 MiB
    with pytest.raises(InferenceServerException) as raised:
        client.infer("matmul", matmul_inputs(big), headers=AUTH)
    assert "RESOURCE_EXHAUSTED" in str(raised.value.status())


def test_a_deadline_too_short_is_deadline_exceeded(client: triton.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException) as raised:
        client.infer("matmul", matmul_inputs(X), headers=AUTH, client_timeout=0.0005)
    assert "DEADLINE_EXCEEDED" in str(raised.value.status())
    # The gateway is unharmed: the next call is answered.
    assert np.all(client.infer("matmul", matmul_inputs(X), headers=AUTH).as_numpy("y") == -48)


def test_malformed_protobuf_bytes_get_a_status(mesh: LocalMesh) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{mesh.grpc_port}") as channel:
        raw = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        with pytest.raises(grpc.RpcError) as raised:
            raw(b"\xff\xff\xff\xff\x0f garbage", metadata=tuple(AUTH.items()))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "inference.ModelInferRequest" in raised.value.details()


def test_a_malformed_message_on_a_stream_ends_it_after_the_answers_before(
    mesh: LocalMesh,
) -> None:
    """Found by the gRPC fuzz: the stream ended INTERNAL (the TaskGroup wrapped the parse
    error), or with no status at all when an answer was being written as it aborted."""
    request = pb.ModelInferRequest(model_name="matmul", id="first")
    request.inputs.add(name="x", datatype="FP32", shape=[128, 96])
    request.raw_input_contents.append(X.tobytes())
    with grpc.insecure_channel(f"127.0.0.1:{mesh.grpc_port}") as channel:
        stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")
        messages = iter((request.SerializeToString(), b"\xff\xff\xff\xff\x0f garbage"))
        answers = stream(messages, metadata=tuple(AUTH.items()), timeout=120)
        received = []
        with pytest.raises(grpc.RpcError) as raised:
            received.extend(pb.ModelStreamInferResponse.FromString(raw) for raw in answers)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value.details()
    assert "inference.ModelInferRequest" in raised.value.details()
    assert [r.infer_response.id for r in received] == ["first"]
    y = np.frombuffer(received[0].infer_response.raw_output_contents[0], np.float32)
    assert np.all(y == -48.0)


def test_a_repository_command_without_a_model_name_is_invalid(
    stub: pb_grpc.GRPCInferenceServiceStub,
) -> None:
    """Found by the gRPC fuzz (an empty model_name answered INTERNAL)."""
    with pytest.raises(grpc.RpcError) as raised:
        stub.RepositoryModelLoad(
            pb.RepositoryModelLoadRequest(model_name=""), metadata=tuple(AUTH.items())
        )
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "1-128 characters" in raised.value.details()


# -- KServe's Python client (kserve.InferenceGRPCClient), unchanged -----------------------

KSERVE_SEED = 11


@pytest.fixture(scope="module")
def kserve(mesh: LocalMesh) -> dict[str, Any]:
    """What KServe's client got, in a process of its own (see kserve_client_calls.py)."""
    done = subprocess.run(
        [sys.executable, str(KSERVE_CALLS), f"127.0.0.1:{mesh.grpc_port}", TOKEN]
        + [str(KSERVE_SEED)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    answers: dict[str, Any] = json.loads(done.stdout)
    return answers


def test_kserve_client_health(kserve: dict[str, Any]) -> None:
    assert kserve["live"] is True and kserve["ready"] is True
    assert kserve["model_ready"] is True and kserve["unknown_model_ready"] is False


def test_kserve_model_metadata(kserve: dict[str, Any]) -> None:
    metadata = kserve["metadata"]
    assert metadata["name"] == "matmul" and metadata["platform"]
    assert metadata["inputs"] == [["x", "FP32", [128, 96]]]
    assert metadata["outputs"] == [["y", "FP32", [128, 16]]]


@pytest.mark.parametrize("form", ["raw", "contents"])
def test_kserve_client_infer_on_the_demo_gives_minus_48(kserve: dict[str, Any], form: str) -> None:
    """raw: the tensor in raw_input_contents; contents: a list, sent as fp32_contents."""
    answer = kserve[form]
    assert (answer["id"], answer["model_name"], answer["name"]) == ("k-1", "matmul", "y")
    assert answer["shape"] == [128, 16] and answer["dtype"] == "float32"
    assert set(answer["values"]) == {-48.0}


def test_kserve_client_binary_tensors_match_the_unsliced_model(kserve: dict[str, Any]) -> None:
    x = np.random.default_rng(KSERVE_SEED).standard_normal((128, 96)).astype(np.float32)
    y = np.array(kserve["random"]["values"], np.float32).reshape(128, 16)
    assert np.max(np.abs(y - unsliced(x))) <= 1e-5


@pytest.mark.parametrize(
    ("case", "code", "words"),
    [
        ("unknown-model", "NOT_FOUND", "nope"),
        ("wrong-shape", "INVALID_ARGUMENT", "95"),
        ("no-token", "UNAUTHENTICATED", "bearer token"),
    ],
)
def test_kserve_client_errors_are_their_status(
    kserve: dict[str, Any], case: str, code: str, words: str
) -> None:
    status = kserve["errors"][case]
    assert status["code"] == code, status
    assert words in status["details"]

"""Serving features on a real mesh (`shardserve up`, real agents, onnxruntime, RabbitMQ):
Python pre/post-processing stages, dynamic batching, MindSpore-style stage errors, a
version added while running, and the unload of a version.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from shardserve.amqp.broker import Broker
from shardserve.process.settings import BrokerSettings
from shardserve.tools.common import model_bytes
from shardserve.tools.export.mlp import reference_model
from shardserve.wire import topology
from shardserve.wire.protocol import RepositoryCommand

pytestmark = pytest.mark.integration

HIDDEN = 32
MLP_ARGS = (
    "--hidden",
    "32",
    "--ffn",
    "64",
    "--layers",
    "2",
    "--rank-size",
    "2",
    "--stage-size",
    "1",
)

SERVABLE_CONFIG = """
import numpy as np

from shardserve.servable import add_stage, declare_servable, register_method

model = declare_servable(rank_size=2, stage_size=1, with_batch_dim=True)


def scale(x):
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"x must be a matrix, got shape {list(x.shape)}")
    return x * 2


def softmax(y):
    e = np.exp(y - y.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)


@register_method(output_names=["y"])
def predict(x):
    x2 = add_stage(scale, x, outputs_count=1, tag="Preprocess")
    return add_stage(model, x2, outputs_count=1)


@register_method(output_names=["probs"])
def predict_softmax(x):
    y = add_stage(model, x, outputs_count=1)
    return add_stage(softmax, y, outputs_count=1, tag="Postprocess")
"""


def reference(x: np.ndarray, seed: int) -> np.ndarray:
    model = reference_model(hidden=HIDDEN, ffn=64, layers=2, seed=seed)
    session = ort.InferenceSession(model_bytes(model), providers=["CPUExecutionProvider"])
    (y,) = session.run(None, {"x": x.astype(np.float32)})
    return np.asarray(y)


def softmax(y: np.ndarray) -> np.ndarray:
    e = np.exp(y - y.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def post(mesh: Any, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    request = urllib.request.Request(
        mesh.http_url + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def infer(mesh: Any, path: str, *xs: np.ndarray) -> tuple[int, Any]:
    return post(mesh, path, {"instances": [{"x": x.tolist()} for x in xs]})


def version_status(mesh: Any, version: int) -> dict[str, Any] | None:
    for s in mesh.status()["servables"]:
        if s["name"] == "mlp" and s["version"] == version:
            return s  # type: ignore[no-any-return]
    return None


def wait_for(what: str, check: Any, mesh: Any, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}:\n{mesh.log_tail()}")


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory, export_repo: Any) -> Path:
    root = export_repo("mlp", tmp_path_factory.mktemp("repo"), *MLP_ARGS)
    (root / "mlp" / "servable_config.py").write_text(SERVABLE_CONFIG)
    return root  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def mesh(repo: Path, mesh_factory: Any) -> Iterator[Any]:
    # A longer batch window than the default 2 ms, so concurrent requests surely meet.
    patch = pytest.MonkeyPatch()
    patch.setenv("SHARDSERVE_SCHEDULER_MAX_BATCH_DELAY_MS", "50")
    patch.setenv("SHARDSERVE_SCHEDULER_REPOSITORY_POLL_SECONDS", "1")
    try:
        yield mesh_factory(repo)
    finally:
        patch.undo()


def test_python_stages_around_the_distributed_model(mesh: Any) -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, HIDDEN)).astype(np.float32)
    code, body = infer(mesh, "/model/mlp:predict", x)
    assert code == 200, body
    np.testing.assert_allclose(body["instances"][0]["y"], reference(x * 2, 0), atol=1e-4)
    code, body = infer(mesh, "/model/mlp:predict_softmax", x)
    assert code == 200, body
    probs = np.asarray(body["instances"][0]["probs"])
    np.testing.assert_allclose(probs, softmax(reference(x, 0)), atol=1e-5)
    inputs = {
        m["name"]: m["inputs"][0]
        for m in version_status(mesh, 1)["methods"]  # type: ignore[index]
    }
    assert inputs["predict"]["datatype"] == "ANY"  # read by a Python stage first
    assert inputs["predict_softmax"]["datatype"] == "FP32"


def test_concurrent_requests_are_batched_and_answered_right(mesh: Any) -> None:
    before = version_status(mesh, 1)
    assert before is not None
    rng = np.random.default_rng(2)
    xs = [rng.standard_normal((1 + i % 3, HIDDEN)).astype(np.float32) for i in range(12)]
    with ThreadPoolExecutor(len(xs)) as pool:
        answers = list(pool.map(lambda x: infer(mesh, "/model/mlp:predict_softmax", x), xs))
    for x, (code, body) in zip(xs, answers, strict=True):
        assert code == 200, body
        np.testing.assert_allclose(
            body["instances"][0]["probs"], softmax(reference(x, 0)), atol=1e-5
        )

    # The status is broadcast about once a second: wait for one taken after the batches.
    def counted() -> bool:
        now = version_status(mesh, 1) or before
        return bool(now["batched_instances_total"] - before["batched_instances_total"] >= len(xs))

    wait_for("batch counters", counted, mesh, timeout=15)
    after = version_status(mesh, 1)
    assert after is not None
    batches = after["batches_total"] - before["batches_total"]
    members = after["batched_instances_total"] - before["batched_instances_total"]
    # ``before`` may predate the previous test's last requests (status lag): at least ours.
    assert members >= len(xs), after
    assert 1 <= batches < members, (batches, members)  # several instances shared jobs


def test_a_python_stage_error_is_a_mindspore_style_400(mesh: Any) -> None:
    code, body = post(mesh, "/model/mlp:predict", {"instances": [{"x": [1.0, 2.0]}]})
    assert code == 400, body
    assert body["error_msg"] == (
        "Call Preprocess Failed, method: 'predict', stage index(begin with 1): 1, "
        "error msg: x must be a matrix, got shape [2]"
    )
    # one bad instance among good ones: per-instance outcome, status 200
    good = np.ones((1, HIDDEN), np.float32).tolist()
    code, body = post(mesh, "/model/mlp:predict", {"instances": [{"x": good}, {"x": [1.0]}]})
    assert code == 200, body
    assert "y" in body["instances"][0]
    assert body["instances"][1]["error_msg"].startswith("Call Preprocess Failed")


def _start_agents(mesh: Any, repo: Path, version: int) -> list[subprocess.Popen[bytes]]:
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "shardserve_agent",
                "--repository",
                str(repo),
                "--servable",
                "mlp",
                "--version",
                str(version),
                "--rank",
                str(rank),
            ],
            env=mesh.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for rank in (0, 1)
    ]


async def _command(url: str, action: str, version: int) -> None:
    broker = Broker(BrokerSettings(urls=(url,)), f"test-cmd-{uuid.uuid4().hex[:6]}")
    await broker.connect()
    try:
        command = RepositoryCommand(action=action, servable="mlp", version=version)  # type: ignore[arg-type]
        await broker.publish(
            topology.CONTROL_EXCHANGE, topology.KEY_SCHEDULER_COMMAND, command, confirm=True
        )
    finally:
        await broker.close()


async def test_a_new_version_comes_up_and_the_old_one_unloads(
    mesh: Any, repo: Path, export_repo: Any, tmp_path: Path
) -> None:
    staging = export_repo("mlp", tmp_path / "staging", *MLP_ARGS, "--version", "2", "--seed", "1")
    shutil.move(str(staging / "mlp" / "2"), str(repo / "mlp" / "2"))
    wait_for("v2 in the status", lambda: version_status(mesh, 2) is not None, mesh)
    agents = _start_agents(mesh, repo, 2)
    try:
        wait_for("v2 ready", lambda: (version_status(mesh, 2) or {}).get("ready"), mesh)
        x = np.random.default_rng(3).standard_normal((2, HIDDEN)).astype(np.float32)
        code, body = infer(mesh, "/model/mlp:predict_softmax", x)  # version 0 = highest ready
        assert code == 200, body
        np.testing.assert_allclose(
            body["instances"][0]["probs"], softmax(reference(x, 1)), atol=1e-5
        )
        code, body = infer(mesh, "/model/mlp/version/1:predict_softmax", x)
        assert code == 200, body
        np.testing.assert_allclose(
            body["instances"][0]["probs"], softmax(reference(x, 0)), atol=1e-5
        )

        await _command(mesh.amqp_url, "unload", 1)
        wait_for("v1 gone", lambda: version_status(mesh, 1) is None, mesh)
        code, body = infer(mesh, "/model/mlp/version/1:predict_softmax", x)
        assert code == 404, body
        code, body = infer(mesh, "/model/mlp:predict_softmax", x)
        assert code == 200, body
    finally:
        for agent in agents:
            agent.terminate()
        for agent in agents:
            agent.wait(30)

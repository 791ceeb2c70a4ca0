"""The serving mesh end to end: real RabbitMQ, real processes, real onnxruntime.

Each parametrised mesh is exported the way a user does (`shardserve export matmul ...`),
started with `shardserve up`, and driven over HTTP. Answers are compared with the unsliced
model run directly in onnxruntime.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import numpy as np
import onnxruntime as ort
import pytest

from shardserve.tools.export.matmul import reference_model

pytestmark = pytest.mark.integration

CONFIGS = [
    pytest.param(("1", "1", "column"), id="rank1"),
    pytest.param(("8", "1", "column"), id="rank8-column"),
    pytest.param(("8", "1", "row"), id="rank8-row"),
    pytest.param(("16", "2", "column"), id="rank16-stage2-column"),
    pytest.param(("16", "2", "row"), id="rank16-stage2-row"),
]


def unsliced(x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(
        reference_model().SerializeToString(), providers=["CPUExecutionProvider"]
    )
    return session.run(None, {"x": x})[0]  # type: ignore[no-any-return]


def infer_body(x: np.ndarray) -> dict[str, Any]:
    data = x.ravel().tolist()
    return {"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": data}]}


async def post(url: str, body: Any) -> tuple[int, Any]:
    data = body if isinstance(body, bytes | str) else json.dumps(body)
    headers = {"Content-Type": "application/json"}
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, data=data, headers=headers) as r,
    ):
        return r.status, await r.json(content_type=None)


def output_y(reply: dict[str, Any]) -> np.ndarray:
    (out,) = [o for o in reply["outputs"] if o["name"] == "y"]
    assert out["datatype"] == "FP32"
    assert out["shape"] == [128, 16]
    return np.asarray(out["data"], np.float32).reshape(out["shape"])


@pytest.fixture(scope="module", params=CONFIGS)
def matmul_mesh(
    request: pytest.FixtureRequest, mesh_factory: Any, export_repo: Any, tmp_path_factory: Any
) -> Iterator[Any]:
    rank, stage, strategy = request.param
    repo = export_repo(
        "matmul",
        tmp_path_factory.mktemp("repo"),
        "--rank-size",
        rank,
        "--stage-size",
        stage,
        "--strategy",
        strategy,
    )
    mesh = mesh_factory(repo)
    yield mesh
    assert mesh.stop() == 0, mesh.log_tail()


async def test_curl_scenario_all_ones(matmul_mesh: Any) -> None:
    """The README's curl: ones(128, 96) -> every element -48.0."""
    x = np.ones((128, 96), np.float32)
    status, reply = await post(f"{matmul_mesh.http_url}/v2/models/matmul/infer", infer_body(x))
    assert status == 200, reply
    assert reply["model_name"] == "matmul"
    y = output_y(reply)
    assert np.all(y == -48.0)


async def test_matches_unsliced_model(matmul_mesh: Any) -> None:
    x = np.random.default_rng(7).standard_normal((128, 96)).astype(np.float32)
    status, reply = await post(f"{matmul_mesh.http_url}/v2/models/matmul/infer", infer_body(x))
    assert status == 200, reply
    assert np.max(np.abs(output_y(reply) - unsliced(x))) <= 1e-5


async def test_health_and_model_ready(matmul_mesh: Any) -> None:
    assert matmul_mesh.get("/v2/health/live")[0] == 200
    assert matmul_mesh.get("/v2/health/ready")[0] == 200
    status, body = matmul_mesh.get("/v2/models/matmul/ready")
    assert status == 200 and body["ready"] is True


async def test_fifty_concurrent_requests_each_get_their_own_answer(matmul_mesh: Any) -> None:
    rng = np.random.default_rng(11)
    xs = [rng.standard_normal((128, 96)).astype(np.float32) for _ in range(50)]
    url = f"{matmul_mesh.http_url}/v2/models/matmul/infer"
    replies = await asyncio.gather(*(post(url, infer_body(x)) for x in xs))
    for x, (status, reply) in zip(xs, replies, strict=True):
        assert status == 200, reply
        assert np.max(np.abs(output_y(reply) - unsliced(x))) <= 1e-5
    # The MatMul has no batch dim: requests that arrived while the ranks were busy went as
    # stacked jobs (several instances per job), and each still got its own answer above.
    instances, jobs = (f"shardserve_servable_{n}_total" for n in ("batched_instances", "batches"))
    await _until(lambda: matmul_mesh.metric(instances) >= 50)
    assert matmul_mesh.metric(jobs) < matmul_mesh.metric(instances)


async def _until(condition: Any, within_s: float = 15.0) -> None:
    """Wait for the scheduler's next status (counters arrive with it)."""
    deadline = asyncio.get_running_loop().time() + within_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "status never caught up"
        await asyncio.sleep(0.2)

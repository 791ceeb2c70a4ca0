"""Bad input, registration refusals and an unready group, on a running 8-rank mesh."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.integration

SHARDSERVE = str(Path(sys.executable).parent / "shardserve")


def post(mesh: Any, path: str, body: Any) -> tuple[int, dict[str, Any], str]:
    import urllib.error
    import urllib.request

    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(
        mesh.http_url + path, data=data, method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read()), resp.headers.get("Content-Type", "")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), exc.headers.get("Content-Type", "")


def x_input(**overrides: Any) -> dict[str, Any]:
    tensor = {"name": "x", "shape": [128, 96], "datatype": "FP32", "data": [1.0] * (128 * 96)}
    tensor.update(overrides)
    return tensor


BAD_INPUTS = [
    pytest.param(
        "/v2/models/nosuch/infer", {"inputs": [x_input()]}, 404, "nosuch", id="unknown-model"
    ),
    pytest.param(
        "/v2/models/matmul/infer",
        {"inputs": [{"name": "z", "shape": [1], "datatype": "FP32", "data": [1.0]}]},
        400,
        "missing input(s): x",
        id="missing-input",
    ),
    pytest.param("/v2/models/matmul/infer", {"inputs": []}, 400, "inputs", id="no-inputs"),
    pytest.param(
        "/v2/models/matmul/infer",
        {"inputs": [x_input(), {"name": "z", "shape": [1], "datatype": "FP32", "data": [1.0]}]},
        400,
        "z",
        id="extra-input",
    ),
    pytest.param(
        "/v2/models/matmul/infer",
        {"inputs": [x_input(shape=[96, 128])]},
        400,
        "shape",
        id="wrong-shape",
    ),
    pytest.param(
        "/v2/models/matmul/infer",
        {"inputs": [x_input(datatype="INT32", data=[1] * (128 * 96))]},
        400,
        "datatype",
        id="wrong-datatype",
    ),
    pytest.param(
        "/v2/models/matmul/infer",
        {"inputs": [x_input(data=[1.0] * 100)]},
        400,
        "12288",
        id="data-length",
    ),
    pytest.param("/v2/models/matmul/infer", b"{not json", 400, "JSON", id="not-json"),
]


@pytest.mark.parametrize(("path", "body", "status", "needle"), BAD_INPUTS)
def test_bad_input_gets_clear_error(
    mesh_matmul8: Any, path: str, body: Any, status: int, needle: str
) -> None:
    got, reply, content_type = post(mesh_matmul8, path, body)
    assert got == status, reply
    assert content_type == "application/json"
    assert needle.lower() in reply["error"].lower(), reply


def test_bad_input_never_reaches_the_broker(mesh_matmul8: Any) -> None:
    before = published_requests(mesh_matmul8)
    for path, body, _, _ in (p.values for p in BAD_INPUTS):
        post(mesh_matmul8, path, body)
    assert published_requests(mesh_matmul8) == before
    # ...while a good request is counted: the counter is live, so the check above can fail
    good = {"inputs": [x_input()]}
    assert post(mesh_matmul8, "/v2/models/matmul/infer", good)[0] == 200
    assert published_requests(mesh_matmul8) == before + 1


def published_requests(mesh: Any) -> float:
    return float(mesh.metric("shardserve_gateway_published_requests_total"))


def run_agent(mesh: Any, rank: int, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    args = [
        SHARDSERVE,
        "agent",
        "--repository",
        str(mesh.repo),
        "--servable",
        "matmul",
        "--rank",
        str(rank),
        "--no-cache",
    ]
    return subprocess.run(args, env=mesh.env, capture_output=True, text=True, timeout=timeout)


def test_second_agent_for_a_taken_rank_is_refused(mesh_matmul8: Any) -> None:
    done = run_agent(mesh_matmul8, 3)
    assert done.returncode == 3, done.stderr
    assert "rank 3" in done.stderr and "already" in done.stderr, done.stderr
    assert "already" in mesh_matmul8.log_tail(400)
    assert mesh_matmul8.get("/v2/health/ready")[0] == 200  # the real rank 3 is untouched


def test_agent_outside_the_group_is_refused(mesh_matmul8: Any) -> None:
    done = run_agent(mesh_matmul8, 8)
    assert done.returncode == 3, done.stderr
    assert "outside" in done.stderr, done.stderr
    assert "outside" in mesh_matmul8.log_tail(400)


def test_hung_rank_makes_group_unready_then_heals(mesh_matmul8: Any) -> None:
    pid = mesh_matmul8.rank_pid("matmul", 5)
    os.kill(pid, signal.SIGSTOP)
    try:
        status, body = wait_for(lambda: mesh_matmul8.get("/v2/models/matmul/ready"), 503, 15)
        assert "5" in body["error"], body
        x = np.ones((128, 96), np.float32)
        body_in = {"inputs": [x_input(data=x.ravel().tolist())]}
        got, reply, _ = post(mesh_matmul8, "/v2/models/matmul/infer", body_in)
        assert got == 503 and "5" in reply["error"], reply
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_for(lambda: mesh_matmul8.get("/v2/models/matmul/ready"), 200, 30)
    got, reply, _ = post(mesh_matmul8, "/v2/models/matmul/infer", {"inputs": [x_input()]})
    assert got == 200, reply


def wait_for(probe: Any, status: int, timeout: float) -> tuple[int, Any]:
    deadline = time.monotonic() + timeout
    last: tuple[int, Any] = (0, None)
    while time.monotonic() < deadline:
        last = probe()
        if last[0] == status:
            return last
        time.sleep(0.2)
    raise AssertionError(f"expected status {status} within {timeout}s, last {last}")


async def test_malformed_amqp_is_dead_lettered_and_counted(mesh_matmul8: Any) -> None:
    import aio_pika

    from shardserve.wire import topology

    before = mesh_matmul8.metric("shardserve_dead_lettered_total")
    connection = await aio_pika.connect(mesh_matmul8.amqp_url)
    async with connection:
        channel = await connection.channel()
        exchange = await channel.get_exchange(topology.REQUESTS_EXCHANGE)
        for body in (b"\xc1 not msgpack", b"\x81\xa1v\x63"):  # bad bytes; schema version 99
            await exchange.publish(aio_pika.Message(body), routing_key="matmul")
    deadline = time.monotonic() + 15
    while mesh_matmul8.metric("shardserve_dead_lettered_total") < before + 2:
        assert time.monotonic() < deadline, "dead letters were not counted"
        await asyncio.sleep(0.3)
    assert mesh_matmul8.get("/v2/health/ready")[0] == 200  # the consumer kept running


def run_agent_in(mesh: Any, repository: Path, rank: int) -> subprocess.CompletedProcess[str]:
    args = [
        SHARDSERVE,
        "agent",
        "--repository",
        str(repository),
        "--servable",
        "matmul",
        "--rank",
        str(rank),
        "--no-cache",
    ]
    return subprocess.run(args, env=mesh.env, capture_output=True, text=True, timeout=60)


def test_agent_whose_slice_is_not_on_this_host_is_refused_at_registration(
    mesh_matmul8: Any, tmp_path: Path
) -> None:
    bundle = tmp_path / "host-a"
    subprocess.run(
        [SHARDSERVE, "pack", str(mesh_matmul8.repo), "--ranks", "0-1", "--out", str(bundle)],
        check=True,
        capture_output=True,
        timeout=60,
    )
    done = run_agent_in(mesh_matmul8, bundle, 3)
    assert done.returncode == 3, done.stderr
    assert "not on this host" in done.stderr, done.stderr
    assert "refused rank 3" in done.stderr  # the scheduler's verdict, logged by the agent


def test_agent_with_a_tampered_slice_is_refused_at_registration(
    mesh_matmul8: Any, tmp_path: Path
) -> None:
    copy = tmp_path / "repo"
    shutil.copytree(mesh_matmul8.repo, copy)
    segment = next((copy / "matmul" / "1" / "rank_2").glob("*.onnx"))
    segment.write_bytes(segment.read_bytes() + b"\0")
    done = run_agent_in(mesh_matmul8, copy, 2)
    assert done.returncode == 3, done.stderr
    assert "sha256" in done.stderr, done.stderr
    assert "slice checksum mismatch for rank 2" in done.stderr  # the scheduler's words
    assert "slice checksum mismatch for rank 2" in mesh_matmul8.log_tail(600)

"""Input values a dynamic-shape model cannot take are refused with 400 before they reach the
agents: token ids outside the vocabulary and sequences past the position table, on a real
transformer mesh (2 ranks), over HTTP and over the queue-level API."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import aio_pika
import numpy as np
import pytest
from conditions import beaten_since, wait_until
from queue_roundtrip import roundtrip

from shardserve.errors import ErrorCode
from shardserve.wire.protocol import InferRequest
from shardserve.wire.tensors import Tensor

pytestmark = pytest.mark.integration

VOCAB, MAX_SEQ = 50, 8
INFER = "/v2/models/transformer/infer"


@pytest.fixture(scope="module")
def mesh(mesh_factory: Any, export_repo: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    repo = export_repo(
        "transformer",
        tmp_path_factory.mktemp("repo"),
        *("--layers", "1", "--hidden", "32", "--heads", "4"),
        *("--vocab", str(VOCAB), "--max-seq", str(MAX_SEQ)),
        *("--rank-size", "2", "--stage-size", "1"),
    )
    return mesh_factory(Path(repo))


def ids_body(rows: list[list[int]]) -> dict[str, Any]:
    shape = [len(rows), len(rows[0])]
    data = [token for row in rows for token in row]
    return {"inputs": [{"name": "input_ids", "shape": shape, "datatype": "INT64", "data": data}]}


def post(mesh: Any, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        mesh.http_url + path,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def mesh_counts(mesh: Any, status: dict[str, Any] | None = None) -> tuple[int, int]:
    """(requests the scheduler accepted, stage jobs the agents finished) for the transformer,
    from the latest MeshStatus: what reached the mesh, whatever the gateway did."""
    status = mesh.status() if status is None else status
    (servable,) = [s for s in status["servables"] if s["name"] == "transformer"]
    return servable["requests_total"], sum(rank["jobs_done"] for rank in servable["ranks"])


def wait_for_counts(mesh: Any, at_least: tuple[int, int], timeout: float = 30.0) -> tuple[int, int]:
    """The counts once both reach ``at_least`` (status and heartbeats lag the work)."""
    deadline = time.monotonic() + timeout
    counts = mesh_counts(mesh)
    while any(got < want for got, want in zip(counts, at_least, strict=True)):
        assert time.monotonic() < deadline, f"counts stuck at {counts}, waiting for {at_least}"
        time.sleep(0.2)
        counts = mesh_counts(mesh)
    return counts


BAD_ROWS: dict[str, tuple[list[list[int]], str]] = {
    "token-past-vocab": ([[1, 2, VOCAB]], "outside [0, 49]: found 50"),
    "negative-token": ([[-1, 2, 3]], "outside [0, 49]: found -1"),
    "sequence-too-long": ([[1] * (MAX_SEQ + 1)], "dimension 1 is 9, at most 8 allowed"),
}
BAD = [pytest.param(rows, needle, id=name) for name, (rows, needle) in BAD_ROWS.items()]


@pytest.mark.parametrize(("rows", "needle"), BAD)
def test_bad_values_get_400_naming_the_bound(mesh: Any, rows: list[list[int]], needle: str) -> None:
    status, reply = post(mesh, INFER, ids_body(rows))
    assert status == 400, reply
    assert "input_ids" in reply["error"] and needle in reply["error"], reply


def test_mindspore_rest_applies_the_same_bounds(mesh: Any) -> None:
    body = {"instances": [{"input_ids": [[7, VOCAB]]}]}
    status, reply = post(mesh, "/model/transformer:predict", body)
    assert status == 400, reply
    assert "outside [0, 49]: found 50" in json.dumps(reply), reply


def test_bad_values_never_reach_the_agents(mesh: Any) -> None:
    """Bad requests, then one good one: the mesh counts exactly the good one (1 request, one job
    on each of the 2 ranks). Had a bad one been run, the counts would be higher."""
    requests, jobs = wait_for_counts(mesh, (0, 0))
    for rows, _ in BAD_ROWS.values():
        assert post(mesh, INFER, ids_body(rows))[0] == 400
    status, reply = post(mesh, INFER, ids_body([[0] * (MAX_SEQ - 1) + [VOCAB - 1]]))
    assert status == 200, reply
    (logits,) = reply["outputs"]
    assert logits["name"] == "logits" and logits["shape"] == [1, MAX_SEQ, VOCAB]
    expected = (requests + 1, jobs + 2)
    assert wait_for_counts(mesh, expected) == expected
    # a later heartbeat of every rank, in a later status: nothing else trickles in
    since = mesh.status()["time"]

    def later() -> dict[str, Any] | None:
        status: dict[str, Any] = mesh.status()
        return status if beaten_since(status, "transformer", since) else None

    assert mesh_counts(mesh, wait_until("a later heartbeat of every rank", later)) == expected


def test_status_carries_the_bounds_and_metadata_keeps_its_shape(mesh: Any) -> None:
    (servable,) = [s for s in mesh.status()["servables"] if s["name"] == "transformer"]
    (method,) = servable["methods"]
    (spec,) = method["inputs"]
    assert (spec["min_value"], spec["max_value"]) == (0, VOCAB - 1)
    assert spec["max_shape"] == [-1, MAX_SEQ]
    with urllib.request.urlopen(mesh.http_url + "/v2/models/transformer", timeout=10) as resp:
        metadata = json.loads(resp.read())
    (tensor,) = metadata["inputs"]
    assert tensor["name"] == "input_ids" and tensor["shape"] == [-1, -1]


async def test_queue_level_request_gets_bad_input_from_the_scheduler(mesh: Any) -> None:
    """A request published straight to the exchange skips the gateway; the scheduler refuses it."""
    request = InferRequest(
        id=f"bounds-{uuid.uuid4().hex[:8]}",
        servable="transformer",
        instances=({"input_ids": Tensor.from_numpy(np.array([[3, VOCAB + 7]], np.int64))},),
        deadline=time.time() + 30,
    )
    async with await aio_pika.connect(mesh.amqp_url) as connection:
        reply = await roundtrip(connection, request, expire=False)
    error = reply.error or (reply.instances[0].error if reply.instances else None)
    assert error is not None and error.code == ErrorCode.BAD_INPUT, reply
    assert "outside [0, 49]: found 57" in error.message

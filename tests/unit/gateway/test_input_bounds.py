"""The gateway refuses input values/dimensions outside the signature's bounds (from MeshStatus)
with 400, on both HTTP APIs, and publishes nothing for them."""

from __future__ import annotations

from typing import Any

import pytest
from gateway_fakes import MakeGateway, servable

from shardserve.wire.protocol import MethodStatus, TensorSpec

IDS = TensorSpec(
    name="input_ids",
    datatype="INT64",
    shape=(-1, -1),
    min_value=0,
    max_value=49,
    max_shape=(-1, 8),
)
LOGITS = TensorSpec(name="logits", datatype="FP32", shape=(-1, -1, 50))
TRANSFORMER = servable(
    "transformer",
    1,
    (MethodStatus(name="predict", inputs=(IDS,), outputs=(LOGITS,)),),
    with_batch_dim=True,
)


def kserve_body(rows: list[list[int]]) -> dict[str, Any]:
    shape = [len(rows), len(rows[0])]
    data = [token for row in rows for token in row]
    return {"inputs": [{"name": "input_ids", "shape": shape, "datatype": "INT64", "data": data}]}


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([[1, 50]], "input 'input_ids' has values outside [0, 49]: found 50"),
        ([[-1, 3]], "input 'input_ids' has values outside [0, 49]: found -1"),
        ([[1] * 9], "input 'input_ids' dimension 1 is 9, at most 8 allowed"),
    ],
)
async def test_kserve_refuses_out_of_bounds_input_unpublished(
    make_gateway: MakeGateway, rows: list[list[int]], message: str
) -> None:
    gw = await make_gateway(TRANSFORMER)
    resp = await gw.client.post("/v2/models/transformer/infer", json=kserve_body(rows))
    assert resp.status == 400
    assert (await resp.json())["error"] == message
    assert gw.dispatcher.requests == []


async def test_mindspore_rest_refuses_out_of_bounds_input_unpublished(
    make_gateway: MakeGateway,
) -> None:
    gw = await make_gateway(TRANSFORMER)
    body = {"instances": [{"input_ids": [[3, 77]]}]}
    resp = await gw.client.post("/model/transformer:predict", json=body)
    assert resp.status == 400
    assert "outside [0, 49]: found 77" in await resp.text()
    assert gw.dispatcher.requests == []


async def test_values_at_the_bounds_are_published(make_gateway: MakeGateway) -> None:
    gw = await make_gateway(TRANSFORMER)
    await gw.client.post("/v2/models/transformer/infer", json=kserve_body([[0] * 7 + [49]]))
    (request,) = gw.dispatcher.requests
    assert request.instances[0]["input_ids"].shape == (1, 8)

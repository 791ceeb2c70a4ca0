"""KServe model repository extension: index, load, unload; error bodies carry ``code``."""

from __future__ import annotations

from gateway_fakes import MATMUL_METHODS, Gateway, MakeGateway, servable

from shardserve.wire.protocol import RepositoryCommand


async def test_extension_is_advertised(gateway: Gateway) -> None:
    body = await (await gateway.client.get("/v2")).json()
    assert "model_repository" in body["extensions"]


async def test_index_lists_versions_with_triton_states(make_gateway: MakeGateway) -> None:
    gw = await make_gateway(
        servable("matmul", 1, MATMUL_METHODS),
        servable(
            "matmul", 2, MATMUL_METHODS, ready=False, reason="rank 1 missing", state="loading"
        ),
        servable("mlp", 1, MATMUL_METHODS, ready=False, reason="draining", state="unloading"),
        servable("old", 3, MATMUL_METHODS, ready=False, reason="slice failed", state="failed"),
    )
    resp = await gw.client.post("/v2/repository/index")
    assert resp.status == 200
    assert await resp.json() == [
        {"name": "matmul", "version": "1", "state": "READY", "reason": ""},
        {"name": "matmul", "version": "2", "state": "LOADING", "reason": "rank 1 missing"},
        {"name": "mlp", "version": "1", "state": "UNLOADING", "reason": "draining"},
        {"name": "old", "version": "3", "state": "UNAVAILABLE", "reason": "slice failed"},
    ]
    ready_only = await gw.client.post("/v2/repository/index", json={"ready": True})
    assert [e["version"] for e in await ready_only.json()] == ["1"]
    bad = await gw.client.post("/v2/repository/index", json={"ready": "yes"})
    assert bad.status == 400
    assert (await bad.json())["code"] == "bad_input"


async def test_index_needs_a_fresh_status(make_gateway: MakeGateway) -> None:
    gw = await make_gateway(status=False)
    resp = await gw.client.post("/v2/repository/index")
    assert resp.status == 503
    assert await resp.json() == {
        "error": "no scheduler status received yet (is the scheduler running?)",
        "code": "unavailable",
    }


async def test_load_and_unload_publish_commands(gateway: Gateway) -> None:
    resp = await gateway.client.post("/v2/repository/models/matmul/load")
    assert (resp.status, await resp.json()) == (200, {"name": "matmul", "load": True})
    resp = await gateway.client.post(
        "/v2/repository/models/matmul/unload", json={"parameters": {"version": 2}}
    )
    assert (resp.status, await resp.json()) == (200, {"name": "matmul", "unload": True})
    assert gateway.dispatcher.commands == [
        RepositoryCommand(action="load", servable="matmul", version=0),
        RepositoryCommand(action="unload", servable="matmul", version=2),
    ]


async def test_load_of_a_servable_not_in_the_status_is_passed_on(gateway: Gateway) -> None:
    # An unloaded servable is (rightly) absent from the status; the scheduler decides.
    resp = await gateway.client.post("/v2/repository/models/resnet/load")
    assert resp.status == 200
    assert gateway.dispatcher.commands[-1].servable == "resnet"


async def test_refused_commands(gateway: Gateway) -> None:
    cases = [
        ("/v2/repository/models/nope/unload", None, 404, "not_found", "unknown model 'nope'"),
        ("/v2/repository/models/matmul/unload", {"parameters": {"version": 9}}, 404, "not_found",
         "unknown version 9"),
        ("/v2/repository/models/matmul:predict/load", None, 400, "bad_input", "not a method"),
        ("/v2/repository/models/matmul/load", {"parameters": {"config": "{}"}}, 400,
         "bad_input", "'config' is not supported"),
        ("/v2/repository/models/matmul/load", {"parameters": {"version": -1}}, 400,
         "bad_input", "positive integer"),
        # (found by the gRPC fuzz, where model_name may also be empty: a 500 before)
        (f"/v2/repository/models/{'m' * 129}/load", None, 400, "bad_input", "1-128 characters"),
    ]  # fmt: skip
    for path, body, status, code, message in cases:
        resp = await gateway.client.post(path, json=body)
        payload = await resp.json()
        assert resp.status == status, (path, payload)
        assert payload["code"] == code
        assert message in payload["error"]
    assert gateway.dispatcher.commands == []


async def test_repository_routes_need_the_token(make_gateway: MakeGateway) -> None:
    gw = await make_gateway(tokens=("s3cret",))
    resp = await gw.client.post("/v2/repository/models/matmul/load")
    assert resp.status == 401
    assert "code" not in await resp.json()  # no ErrorCode describes 401
    ok = await gw.client.post(
        "/v2/repository/models/matmul/load", headers={"Authorization": "Bearer s3cret"}
    )
    assert ok.status == 200

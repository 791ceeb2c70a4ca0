"""KServe v2 routes other than infer: metadata, health, readiness, listing, status, metrics."""

from __future__ import annotations

from gateway_fakes import MATMUL_METHODS, Gateway, MakeGateway, servable

JSON = "application/json"


async def test_server_metadata_on_both_paths(gateway: Gateway) -> None:
    for path in ("/v2", "/v2/"):
        resp = await gateway.client.get(path)
        assert resp.status == 200
        assert resp.headers["Content-Type"] == JSON
        body = await resp.json()
        assert body["name"] == "shardserve"
        assert isinstance(body["version"], str)
        assert "binary_tensor_data" in body["extensions"]


async def test_live(gateway: Gateway) -> None:
    resp = await gateway.client.get("/v2/health/live")
    assert resp.status == 200
    assert await resp.json() == {"live": True}


async def test_ready_when_fresh_and_every_version_ready(gateway: Gateway) -> None:
    resp = await gateway.client.get("/v2/health/ready")
    assert resp.status == 200
    assert await resp.json() == {"ready": True}


async def test_not_ready_names_the_unready_version(make_gateway: MakeGateway) -> None:
    gw = await make_gateway(
        servable("matmul", 1, MATMUL_METHODS),
        servable("matmul", 2, MATMUL_METHODS, ready=False, reason="rank 1 missing"),
    )
    resp = await gw.client.get("/v2/health/ready")
    assert resp.status == 503
    assert resp.headers["Content-Type"] == JSON
    error = (await resp.json())["error"]
    assert "'matmul' version 2 is not ready: rank 1 missing" in error


async def test_not_ready_when_status_is_stale(gateway: Gateway) -> None:
    gateway.clock.advance(7.0)
    resp = await gateway.client.get("/v2/health/ready")
    assert resp.status == 503
    assert "scheduler status is stale (last seen 7.0 s ago)" in (await resp.json())["error"]
    meta = await gateway.client.get("/v2/models/matmul")
    assert meta.status == 503


async def test_still_ready_just_below_the_staleness_limit(gateway: Gateway) -> None:
    gateway.clock.advance(5.9)
    assert (await gateway.client.get("/v2/health/ready")).status == 200


async def test_not_ready_without_any_status(make_gateway: MakeGateway) -> None:
    gw = await make_gateway(status=False)
    resp = await gw.client.get("/v2/health/ready")
    assert resp.status == 503
    assert "no scheduler status received yet" in (await resp.json())["error"]


async def test_not_ready_when_broker_is_down(gateway: Gateway) -> None:
    gateway.dispatcher.available = False
    resp = await gateway.client.get("/v2/health/ready")
    assert resp.status == 503
    assert "message broker is unreachable" in (await resp.json())["error"]


async def test_draining_turns_readiness_and_infer_to_503(gateway: Gateway) -> None:
    gateway.view.draining = True
    assert (await gateway.client.get("/v2/health/ready")).status == 503
    resp = await gateway.client.post("/v2/models/matmul/infer", data=b"{}")
    assert resp.status == 503
    assert "draining" in (await resp.json())["error"]
    assert gateway.dispatcher.requests == []


async def test_list_models_includes_method_names(gateway: Gateway) -> None:
    resp = await gateway.client.get("/v2/models")
    assert await resp.json() == {"models": ["matmul", "matmul:predict_softmax"]}


async def test_model_metadata(gateway: Gateway) -> None:
    resp = await gateway.client.get("/v2/models/matmul")
    assert resp.status == 200
    assert await resp.json() == {
        "name": "matmul",
        "versions": ["1", "2"],
        "platform": "onnxruntime_onnx",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [128, 96]}],
        "outputs": [
            {"name": "y", "datatype": "FP32", "shape": [128, 16]},
            {"name": "s", "datatype": "FP32", "shape": []},
        ],
    }


async def test_model_metadata_of_a_method_and_version(gateway: Gateway) -> None:
    resp = await gateway.client.get("/v2/models/matmul%3Apredict_softmax/versions/1")
    body = await resp.json()
    assert body["name"] == "matmul:predict_softmax"
    assert body["outputs"] == [{"name": "p", "datatype": "FP32", "shape": [128, 16]}]


async def test_metadata_marks_the_batch_dim_dynamic(make_gateway: MakeGateway) -> None:
    gw = await make_gateway(servable("b", 1, MATMUL_METHODS, with_batch_dim=True))
    body = await (await gw.client.get("/v2/models/b")).json()
    assert body["inputs"][0]["shape"] == [-1, 96]


async def test_unknown_model_version_and_method_are_404(gateway: Gateway) -> None:
    cases = {
        "/v2/models/nope": "unknown model 'nope'",
        "/v2/models/matmul/versions/9": "unknown version 9 of model 'matmul'; known: [1, 2]",
        "/v2/models/matmul:nope": "unknown method 'nope' of model 'matmul'",
        "/v2/models/nope/ready": "unknown model 'nope'",
    }
    for path, message in cases.items():
        resp = await gateway.client.get(path)
        assert resp.status == 404, path
        assert resp.headers["Content-Type"] == JSON
        assert message in (await resp.json())["error"]


async def test_malformed_version_is_400(gateway: Gateway) -> None:
    resp = await gateway.client.get("/v2/models/matmul/versions/abc")
    assert resp.status == 400
    assert "positive integer" in (await resp.json())["error"]


async def test_model_ready(make_gateway: MakeGateway) -> None:
    gw = await make_gateway(
        servable("matmul", 1, MATMUL_METHODS),
        servable("matmul", 2, MATMUL_METHODS, ready=False, reason="rank 0 lost"),
    )
    ok = await gw.client.get("/v2/models/matmul/versions/1/ready")
    assert ok.status == 200
    assert await ok.json() == {"name": "matmul", "ready": True}
    # Unversioned: the highest READY version answers.
    assert (await gw.client.get("/v2/models/matmul/ready")).status == 200
    down = await gw.client.get("/v2/models/matmul/versions/2/ready")
    assert down.status == 503
    assert "version 2 is not ready: rank 0 lost" in (await down.json())["error"]


async def test_unknown_route_and_method_give_json_errors(gateway: Gateway) -> None:
    resp = await gateway.client.get("/v3/whatever")
    assert resp.status == 404
    assert resp.headers["Content-Type"] == JSON
    assert (await resp.json())["error"] == "no route for GET /v3/whatever"
    resp = await gateway.client.delete("/v2/models/matmul/infer")
    assert resp.status == 405
    assert resp.headers["Content-Type"] == JSON
    assert "POST" in resp.headers["Allow"]


async def test_api_status(gateway: Gateway) -> None:
    gateway.clock.advance(1.5)
    body = await (await gateway.client.get("/api/status")).json()
    assert body["fresh"] is True
    assert body["age_s"] == 1.5
    assert body["scheduler"] == "test-scheduler"
    assert [s["name"] for s in body["servables"]] == ["matmul", "matmul"]


async def test_api_status_before_any_status(make_gateway: MakeGateway) -> None:
    gw = await make_gateway(status=False)
    assert await (await gw.client.get("/api/status")).json() == {"fresh": False}


async def test_metrics_count_requests_by_outcome(gateway: Gateway) -> None:
    await gateway.client.post("/v2/models/matmul/infer", data=b"not json")
    await gateway.client.post("/v2/models/nope/infer", data=b"{}")
    text = await (await gateway.client.get("/metrics")).text()
    assert (
        'shardserve_gateway_requests_total{servable="matmul",method="predict",status="400"} 1'
        in text
    )
    assert (
        'shardserve_gateway_requests_total{servable="_unknown",method="_unknown",status="404"} 1'
        in text
    )
    assert (
        'shardserve_gateway_request_duration_seconds_count{servable="matmul",method="predict"} 1'
        in text
    )
    assert "shardserve_gateway_inflight_requests 1" in text  # the /metrics request itself


async def test_request_id_is_echoed_or_generated(gateway: Gateway) -> None:
    given = await gateway.client.get("/v2", headers={"X-Request-Id": "abc-123"})
    assert given.headers["X-Request-Id"] == "abc-123"
    generated = await gateway.client.get("/v2")
    assert len(generated.headers["X-Request-Id"]) == 32
    bad = await gateway.client.get("/v2", headers={"X-Request-Id": "x" * 129})
    assert bad.status == 400
    assert "X-Request-Id" in (await bad.json())["error"]

"""/metrics (gateway + mesh), /api/timeseries, the status page and the OpenAPI document
(checked against the app's real router, and used to validate JSON traffic)."""

from __future__ import annotations

import json
import re
from typing import Any

from gateway_fakes import MATMUL_METHODS, Gateway, MakeGateway, ManualClock, servable

from shardserve.wire.protocol import MeshStatus, RankStatus
from shardserve_gateway.app import create_app
from shardserve_gateway.mesh_metrics import render_mesh
from shardserve_gateway.routes.openapi import document
from shardserve_gateway.settings import GatewaySettings
from shardserve_gateway.timeseries import TimeSeries, percentile

ONES = {"inputs": [{"name": "x", "shape": [128, 96], "datatype": "FP32", "data": [1.0] * 12288}]}


def rank(r: int, state: str = "ready", **fields: Any) -> RankStatus:
    return RankStatus(rank=r, stage=0, state=state, **fields)


# ----------------------------------------------------------------- metrics


def test_mesh_metrics_from_status() -> None:
    status = MeshStatus(
        scheduler="s",
        time=0.0,
        dead_lettered=3,
        request_queue_depth=7,
        servables=(
            servable(
                "matmul",
                1,
                MATMUL_METHODS,
                ranks=(
                    rank(0, compute_ms_total=1500.0, collective_ms_total=250.0, jobs_done=4,
                         cache="hit", rss_bytes=1024, heartbeat_age_s=0.4, load_ms=120.0),
                    rank(1, state="lost", cache="miss"),
                ),
                requests_total=5,
                errors_total=1,
                batches_total=2,
                batched_instances_total=5,
                queued=2,
            ),
        ),
    )  # fmt: skip
    text = "\n".join(render_mesh(status))
    r0 = 'servable="matmul",version="1",rank="0",stage="0"'
    r1 = 'servable="matmul",version="1",rank="1",stage="0"'
    sv = 'servable="matmul",version="1"'
    for line in (
        f"shardserve_rank_compute_seconds_total{{{r0}}} 1.5",
        f"shardserve_rank_collective_seconds_total{{{r0}}} 0.25",
        f"shardserve_rank_jobs_done_total{{{r0}}} 4",
        f'shardserve_rank_cache_hit{{{r0},cache="hit"}} 1',
        f'shardserve_rank_cache_hit{{{r1},cache="miss"}} 0',
        f"shardserve_rank_rss_bytes{{{r0}}} 1024",
        f"shardserve_rank_heartbeat_age_seconds{{{r0}}} 0.4",
        f"shardserve_rank_load_seconds{{{r0}}} 0.12",
        f"shardserve_rank_up{{{r1}}} 0",
        f'shardserve_rank_state{{{r1},state="lost"}} 1',
        f"shardserve_servable_requests_total{{{sv}}} 5",
        f"shardserve_servable_errors_total{{{sv}}} 1",
        f"shardserve_servable_queued{{{sv}}} 2",
        f"shardserve_servable_mean_batch_size{{{sv}}} 2.5",
        "shardserve_dead_lettered_total 3",
        "shardserve_request_queue_depth 7",
    ):
        assert line in text.splitlines(), line
    # Every family is announced once, before its samples.
    assert text.count("# TYPE shardserve_rank_up gauge") == 1
    assert render_mesh(None) == []


async def test_metrics_endpoint_has_gateway_and_mesh_families(make_gateway: MakeGateway) -> None:
    gw = await make_gateway(servable("matmul", 1, MATMUL_METHODS, ranks=(rank(0),)))
    await gw.client.post("/v2/models/matmul/infer", json=ONES)
    await gw.client.post("/v2/models/matmul/infer", data=b"not json")
    resp = await gw.client.get("/metrics")
    assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    text = await resp.text()
    labels = 'servable="matmul",method="predict"'
    assert f'shardserve_gateway_requests_total{{{labels},status="200"}} 1' in text
    assert f'shardserve_gateway_errors_total{{{labels},status="400"}} 1' in text
    assert f'shardserve_gateway_errors_total{{{labels},status="200"}}' not in text
    assert "shardserve_gateway_status_fresh 1" in text
    assert 'shardserve_rank_up{servable="matmul",version="1",rank="0",stage="0"} 1' in text
    names = re.findall(r"^# TYPE (\S+) ", text, re.M)
    assert len(names) == len(set(names))


# ----------------------------------------------------------------- time series


def test_timeseries_per_second_points_and_percentiles() -> None:
    clock = ManualClock()
    series = TimeSeries(capacity_s=10, clock=clock)
    for ms in range(1, 101):  # 100 requests in second 1000, 1..100 ms
        series.observe(ms / 1000.0, failed=ms > 98)
    clock.advance(2.0)  # second 1001 is quiet; 1002 is the current (unreported) one
    series.observe(0.5, failed=False)
    points = series.points(last_s=3)
    assert [p["t"] for p in points] == [999, 1000, 1001]
    assert points[0] == {"t": 999, "requests": 0, "errors": 0, "p50_ms": None, "p99_ms": None}
    assert points[1] == {"t": 1000, "requests": 100, "errors": 2, "p50_ms": 50.0, "p99_ms": 99.0}
    assert points[2]["requests"] == 0
    clock.advance(20.0)  # the ring wrapped: old buckets are not mistaken for new seconds
    assert all(p["requests"] == 0 for p in series.points())
    assert percentile([], 50) == 0.0


async def test_timeseries_route_counts_inference_only(gateway: Gateway) -> None:
    await gateway.client.post("/v2/models/matmul/infer", json=ONES)
    await gateway.client.get("/v2/health/live")
    body = await (await gateway.client.get("/api/timeseries?last=5")).json()
    assert body["interval_s"] == 1
    assert len(body["points"]) == 5  # the current second is still open: not counted yet


# ----------------------------------------------------------------- status page


async def test_status_page_is_self_contained_html(make_gateway: MakeGateway) -> None:
    gw = await make_gateway(tokens=("s3cret",))
    resp = await gw.client.get("/")  # open: the shell has no data; its script sends the token
    assert resp.status == 200
    assert resp.headers["Content-Type"] == "text/html; charset=utf-8"
    page = await resp.text()
    assert "/api/status" in page and "/api/timeseries" in page
    assert not re.search(r"""(src|href)=["']?https?:""", page)
    assert (await gw.client.get("/api/status")).status == 401


# ----------------------------------------------------------------- OpenAPI


def _router_routes() -> set[tuple[str, str]]:
    app = create_app(GatewaySettings(gateway_id="gw-openapi"), dispatcher=object())  # type: ignore[arg-type]
    routes = set()
    for route in app.router.routes():
        if route.method == "HEAD":
            continue  # aiohttp adds HEAD to every GET
        info = route.resource.get_info() if route.resource else {}
        path = info.get("path") or info.get("formatter")
        assert path, route
        routes.add((route.method, re.sub(r"\{(\w+):[^}]*\}", r"{\1}", path)))
    return routes


def _document_routes() -> set[tuple[str, str]]:
    methods = {"get", "post", "put", "delete", "patch"}
    return {
        (method.upper(), path)
        for path, item in document()["paths"].items()
        for method in item
        if method in methods
    }


def test_openapi_covers_exactly_the_routes_of_the_app() -> None:
    in_app, documented = _router_routes(), _document_routes()
    assert in_app - documented == set(), "routes missing from the OpenAPI document"
    assert documented - in_app == set(), "documented paths the app does not route"


async def test_openapi_json_is_served_and_json_traffic_validates(gateway: Gateway) -> None:
    resp = await gateway.client.get("/openapi.json")
    assert resp.status == 200
    spec = await resp.json()
    assert spec == json.loads(json.dumps(document()))
    validate = SchemaValidator(spec)
    validate(ONES, "inference_request")
    ok = await gateway.client.post("/v2/models/matmul/infer", json=ONES)
    validate(await ok.json(), "inference_response")
    for path, schema in (
        ("/v2", "server_metadata"),
        ("/v2/models/matmul", "model_metadata"),
        ("/v2/models/matmul/versions/1/ready", "model_ready"),
        ("/v2/models", "model_list"),
        ("/api/timeseries", "timeseries"),
        ("/api/status", "mesh_status"),
    ):
        validate(await (await gateway.client.get(path)).json(), schema)
    validate(await (await gateway.client.post("/v2/repository/index")).json(), "repository_index")
    bad = await gateway.client.post("/v2/models/nope/infer", json=ONES)
    validate(await bad.json(), "error")
    try:
        validate({"inputs": [{"name": 1}]}, "inference_request")
    except AssertionError:
        pass
    else:
        raise AssertionError("the validator accepted an invalid request")


class SchemaValidator:
    """The JSON Schema subset the document uses: $ref, type, properties, required,
    items, enum, anyOf (openapi-core is not a dependency)."""

    TYPES: dict[str, Any] = {
        "object": dict,
        "array": list,
        "string": str,
        "boolean": bool,
        "null": type(None),
        "integer": int,
        "number": (int, float),
    }

    def __init__(self, spec: dict[str, Any]) -> None:
        self.schemas = spec["components"]["schemas"]

    def __call__(self, value: Any, schema_name: str) -> None:
        self.check(value, self.schemas[schema_name], schema_name)

    def check(self, value: Any, schema: dict[str, Any], where: str) -> None:
        if "$ref" in schema:
            self.check(value, self.schemas[schema["$ref"].rsplit("/", 1)[-1]], where)
            return
        if "anyOf" in schema:
            assert any(self._ok(value, s, where) for s in schema["anyOf"]), where
            return
        self._check_type(value, schema, where)
        if "enum" in schema:
            assert value in schema["enum"], f"{where}: {value!r} not in {schema['enum']}"
        if isinstance(value, dict):
            for key in schema.get("required", ()):
                assert key in value, f"{where}: missing {key!r}"
            for key, sub in schema.get("properties", {}).items():
                if key in value:
                    self.check(value[key], sub, f"{where}.{key}")
        if isinstance(value, list) and "items" in schema:
            for i, item in enumerate(value):
                self.check(item, schema["items"], f"{where}[{i}]")

    def _check_type(self, value: Any, schema: dict[str, Any], where: str) -> None:
        kinds = schema.get("type")
        if kinds is None:
            return
        kinds = [kinds] if isinstance(kinds, str) else kinds
        matches = [
            isinstance(value, self.TYPES[k])
            and not (k in ("integer", "number") and isinstance(value, bool))
            for k in kinds
        ]
        assert any(matches), f"{where}: {value!r} is not {kinds}"

    def _ok(self, value: Any, schema: dict[str, Any], where: str) -> bool:
        try:
            self.check(value, schema, where)
        except AssertionError:
            return False
        return True

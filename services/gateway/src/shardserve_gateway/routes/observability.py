"""What an operator looks at: ``GET /`` (status page), ``GET /api/status`` (latest
MeshStatus as JSON), ``GET /api/timeseries`` (per-second traffic of this gateway) and
``GET /metrics`` (Prometheus text for the gateway and the whole mesh).

The status page is one self-contained HTML file (inline CSS, JS and SVG; nothing loaded
from elsewhere) that polls the two JSON routes.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from aiohttp import web

from shardserve.errors import BadInputError
from shardserve.process.integers import POSITIVE_INT_RULE, parse_positive_int
from shardserve_gateway.responses import json_response
from shardserve_gateway.state import DISPATCHER_KEY, MESH_VIEW_KEY, METRICS_KEY, TIMESERIES_KEY

PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MAX_TIMESERIES_S = 3600


def add_routes(app: web.Application) -> None:
    """Register the status page and the observability endpoints."""
    app.router.add_get("/", status_page)
    app.router.add_get("/api/status", api_status)
    app.router.add_get("/api/timeseries", api_timeseries)
    app.router.add_get("/metrics", metrics)


@cache
def status_page_html() -> bytes:
    """The status page, read once from the package."""
    return resources.files("shardserve_gateway").joinpath("static/status.html").read_bytes()


async def status_page(request: web.Request) -> web.Response:
    return web.Response(
        body=status_page_html(),
        content_type="text/html",
        charset="utf-8",
        headers={"Cache-Control": "no-cache"},
    )


async def api_status(request: web.Request) -> web.Response:
    """The latest MeshStatus as JSON, plus ``fresh`` and ``age_s``."""
    view = request.app[MESH_VIEW_KEY]
    status = view.status
    age = view.age_s()
    body = status.model_dump(mode="json") if status is not None else {}
    body["fresh"] = view.fresh()
    if age is not None:
        body["age_s"] = round(age, 3)
    return json_response(body)


async def api_timeseries(request: web.Request) -> web.Response:
    """``{"interval_s": 1, "points": [{"t", "requests", "errors", "p50_ms", "p99_ms"}]}``;
    query ``last=<seconds>`` limits the span."""
    points = request.app[TIMESERIES_KEY].points(min(_last_seconds(request), MAX_TIMESERIES_S))
    return json_response({"interval_s": 1, "points": points})


def _last_seconds(request: web.Request) -> int:
    """Query ``last``: the span in seconds (absent: the whole kept span)."""
    raw = request.query.get("last")
    if raw is None:
        return MAX_TIMESERIES_S
    last = parse_positive_int(raw)
    if last is None:
        raise BadInputError(f"query 'last' must be {POSITIVE_INT_RULE} (seconds), got {raw!r}")
    return last


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text exposition: the gateway's metrics, then the mesh's."""
    app = request.app
    dispatcher = app[DISPATCHER_KEY]
    view = app[MESH_VIEW_KEY]
    text = app[METRICS_KEY].render(
        broker_up=dispatcher.available,
        status_age_s=view.age_s(),
        late_replies=getattr(dispatcher, "late_replies", 0),
        published=getattr(dispatcher, "published", 0),
        request_messages=getattr(getattr(dispatcher, "bundler", None), "bundles", 0),
        failed_early=getattr(dispatcher, "failed_early", 0),
        status_fresh=view.fresh(),
        mesh=view.status,
    )
    return web.Response(body=text.encode("utf-8"), headers={"Content-Type": PROMETHEUS_TYPE})

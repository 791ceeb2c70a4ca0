"""The gateway application: routes, middlewares, and what it owns, in start order.

``create_app`` reads like a table of contents. Owned resources are ``cleanup_ctx``
entries, started in order and torn down in reverse: broker connection -> status
consumer (mesh view) -> reply consumer (dispatcher). Unit tests pass their own
dispatcher and mesh view; then no broker is opened at all.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from aiohttp import web

from shardserve.broker import Broker
from shardserve_gateway import kserve, mindspore_rest
from shardserve_gateway.auth import make_auth_middleware
from shardserve_gateway.dispatch import AmqpDispatcher, Dispatcher
from shardserve_gateway.mesh_view import MeshView, consume_status
from shardserve_gateway.metrics import Metrics
from shardserve_gateway.middleware import request_context, translate_errors
from shardserve_gateway.responses import json_response
from shardserve_gateway.settings import GatewaySettings
from shardserve_gateway.state import (
    DISPATCHER_KEY,
    INFLIGHT_KEY,
    MESH_VIEW_KEY,
    METRICS_KEY,
    SETTINGS_KEY,
    Inflight,
)

BROKER_KEY = web.AppKey("broker", Broker)
CleanupCtx = Callable[[web.Application], AsyncIterator[None]]


def create_app(
    settings: GatewaySettings,
    *,
    dispatcher: Dispatcher | None = None,
    mesh_view: MeshView | None = None,
) -> web.Application:
    """Build the gateway app; without ``dispatcher`` it talks to RabbitMQ."""
    auth = make_auth_middleware(settings.tokens, open_health=settings.open_health)
    middlewares = [request_context, translate_errors] + ([auth] if auth else [])
    app = web.Application(client_max_size=settings.max_body_bytes, middlewares=middlewares)
    app[SETTINGS_KEY] = settings
    app[MESH_VIEW_KEY] = mesh_view or MeshView(settings.status_stale_s)
    app[METRICS_KEY] = Metrics()
    app[INFLIGHT_KEY] = Inflight()
    if dispatcher is None:
        broker = Broker(settings.broker, name=settings.gateway_id)
        amqp = AmqpDispatcher(broker, settings.gateway_id)
        app[BROKER_KEY] = broker
        app[DISPATCHER_KEY] = amqp
        app.cleanup_ctx.extend([_broker_ctx, _status_consumer_ctx, _reply_consumer_ctx_for(amqp)])
    else:
        app[DISPATCHER_KEY] = dispatcher
    kserve.add_routes(app)
    mindspore_rest.add_routes(app)
    app.router.add_get("/api/status", api_status)
    app.router.add_get("/metrics", metrics)
    return app


async def _broker_ctx(app: web.Application) -> AsyncIterator[None]:
    broker = app[BROKER_KEY]
    await broker.connect()
    yield
    await broker.close()


async def _status_consumer_ctx(app: web.Application) -> AsyncIterator[None]:
    # The consumer lives on the broker's channel and stops when the broker closes.
    await consume_status(app[BROKER_KEY], app[MESH_VIEW_KEY], app[SETTINGS_KEY].gateway_id)
    yield


def _reply_consumer_ctx_for(dispatcher: AmqpDispatcher) -> CleanupCtx:
    async def reply_consumer_ctx(app: web.Application) -> AsyncIterator[None]:
        await dispatcher.start()
        yield
        await dispatcher.close()

    return reply_consumer_ctx


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


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text exposition."""
    app = request.app
    dispatcher = app[DISPATCHER_KEY]
    text = app[METRICS_KEY].render(
        broker_up=dispatcher.available,
        status_age_s=app[MESH_VIEW_KEY].age_s(),
        late_replies=getattr(dispatcher, "late_replies", 0),
    )
    return web.Response(text=text, content_type="text/plain", charset="utf-8")

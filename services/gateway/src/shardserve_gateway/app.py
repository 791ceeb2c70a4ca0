"""The gateway application: routes, middlewares, and what it owns, in start order.

``create_app`` reads like a table of contents. Owned resources are ``cleanup_ctx``
entries, started in order and torn down in reverse: broker connection -> status
consumer (mesh view) -> reply consumer (dispatcher). Unit tests pass their own
dispatcher and mesh view; then no broker is opened at all.

Routes: KServe v2 (``kserve``), its model repository extension (``repository``),
MindSpore REST (``mindspore``), the status page, ``/api/status``,
``/api/timeseries`` and ``/metrics`` (``observability``), text generation (``openai``:
OpenAI-compatible ``/v1/...``; ``generate``: Triton's generate extension), and
``/openapi.json`` (``openapi``), which documents all of them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from aiohttp import web

from shardserve.amqp.broker import Broker
from shardserve_gateway.auth import make_auth_middleware
from shardserve_gateway.dispatch import AmqpDispatcher, Dispatcher
from shardserve_gateway.mesh_view import MeshView, consume_status
from shardserve_gateway.metrics import Metrics
from shardserve_gateway.middleware import request_context, translate_errors
from shardserve_gateway.routes import (
    generate,
    kserve,
    mindspore,
    observability,
    openai,
    openapi,
    repository,
)
from shardserve_gateway.settings import GatewaySettings
from shardserve_gateway.state import (
    DISPATCHER_KEY,
    INFLIGHT_KEY,
    MESH_VIEW_KEY,
    METRICS_KEY,
    SETTINGS_KEY,
    TIMESERIES_KEY,
    Inflight,
)
from shardserve_gateway.timeseries import TimeSeries

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
    app[TIMESERIES_KEY] = TimeSeries()
    if dispatcher is None:
        broker = Broker(settings.broker, name=settings.gateway_id)
        amqp = AmqpDispatcher(broker, settings.gateway_id, max_inflight=settings.max_inflight)
        app[MESH_VIEW_KEY].add_scheduler_listener(amqp.scheduler_seen)
        amqp.streams.watch_status(app[MESH_VIEW_KEY].fresh)
        app[BROKER_KEY] = broker
        app[DISPATCHER_KEY] = amqp
        app.cleanup_ctx.extend([_broker_ctx, _status_consumer_ctx, _reply_consumer_ctx_for(amqp)])
    else:
        app[DISPATCHER_KEY] = dispatcher
    kserve.add_routes(app)
    repository.add_routes(app)
    mindspore.add_routes(app)
    observability.add_routes(app)
    openai.add_routes(app)
    generate.add_routes(app)
    openapi.add_routes(app)
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

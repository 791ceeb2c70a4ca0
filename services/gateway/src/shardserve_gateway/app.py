"""The gateway application: routes, middlewares, and what it owns, in start order.

``create_app`` reads like a table of contents. What it owns on the broker is started
in the background by ``BrokerStartup`` (a ``cleanup_ctx`` entry), in order and torn down
in reverse: broker connection -> status consumer (mesh view) -> reply consumer
(dispatcher). HTTP is served meanwhile, so a gateway started before its broker is live
and answers 503 "broker not connected yet" until it is connected. Unit tests pass their
own dispatcher and mesh view; then no broker is opened at all.

Routes: KServe v2 (``kserve``), its model repository extension (``repository``),
MindSpore REST (``mindspore``), the status page, ``/api/status``,
``/api/timeseries`` and ``/metrics`` (``observability``), text generation (``openai``:
OpenAI-compatible ``/v1/...``; ``generate``: Triton's generate extension), and
``/openapi.json`` (``openapi``), which documents all of them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from aiohttp import web

from shardserve.amqp.broker import Broker
from shardserve_gateway.auth import make_auth_middleware
from shardserve_gateway.dispatch import AmqpDispatcher, Dispatcher
from shardserve_gateway.generation.streams import TokenPace
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
_logger = logging.getLogger(__name__)


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
        pace = TokenPace(settings.first_token_timeout_s, settings.token_timeout_s)
        amqp = AmqpDispatcher(
            broker, settings.gateway_id, max_inflight=settings.max_inflight, pace=pace
        )
        app[MESH_VIEW_KEY].add_scheduler_listener(amqp.scheduler_seen)
        amqp.streams.watch_status(app[MESH_VIEW_KEY].fresh)
        app[BROKER_KEY] = broker
        app[DISPATCHER_KEY] = amqp
        app[BROKER_STARTUP_KEY] = BrokerStartup(broker, amqp, app[MESH_VIEW_KEY])
        app.cleanup_ctx.append(_broker_ctx)
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


class BrokerStartup:
    """The gateway's way onto the broker, in the background: HTTP is served at once (live
    200; ready and every inference route 503 "broker not connected yet") while the broker
    connection waits for a broker; then the status and reply consumers start."""

    def __init__(self, broker: Broker, dispatcher: AmqpDispatcher, view: MeshView) -> None:
        self._broker = broker
        self._dispatcher = dispatcher
        self._view = view
        self._dispatcher_started = False
        self.task: asyncio.Task[None] | None = None

    def start(self, owner: str) -> None:
        self._view.waiting_for_broker = True
        self.task = asyncio.create_task(self._connect(owner), name="broker-startup")

    async def _connect(self, owner: str) -> None:
        await self._broker.connect()
        # The status consumer lives on the broker's channel and stops when the broker closes.
        await consume_status(self._broker, self._view, owner)
        self._dispatcher_started = True
        await self._dispatcher.start()
        self._view.waiting_for_broker = False
        _logger.info("gateway connected to the broker %s", self._broker.current_url)

    async def failure(self) -> BaseException:
        """What ended the start-up if it failed (e.g. no broker within
        ``SHARDSERVE_AMQP_CONNECT_WAIT``); once connected, this never returns."""
        assert self.task is not None, "start() first"
        try:
            await asyncio.shield(self.task)
        except Exception as exc:
            return exc
        await asyncio.get_running_loop().create_future()  # connected: nothing left to fail
        raise AssertionError("unreachable")

    async def stop(self) -> None:
        """Give up a wait still running, then close in reverse order of opening."""
        if self.task is not None:
            self.task.cancel()  # (nothing to cancel once it is done: its error is retrieved)
            await asyncio.gather(self.task, return_exceptions=True)
        if self._dispatcher_started:
            await self._dispatcher.close()
        await self._broker.close()


BROKER_STARTUP_KEY = web.AppKey("broker_startup", BrokerStartup)


async def _broker_ctx(app: web.Application) -> AsyncIterator[None]:
    startup = app[BROKER_STARTUP_KEY]
    startup.start(app[SETTINGS_KEY].gateway_id)
    yield
    await startup.stop()

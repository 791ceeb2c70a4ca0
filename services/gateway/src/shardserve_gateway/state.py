"""Typed application state: the AppKeys (never ``app["name"]``) and small shared holders."""

from __future__ import annotations

import asyncio

from aiohttp import web

from shardserve.errors import UnavailableError
from shardserve.process.waits import set_within
from shardserve_gateway.dispatch import Dispatcher
from shardserve_gateway.mesh_view import MeshView
from shardserve_gateway.metrics import UNKNOWN, Labels, Metrics
from shardserve_gateway.settings import GatewaySettings
from shardserve_gateway.timeseries import TimeSeries


class Inflight:
    """Counts HTTP requests being handled; the drain waits until none is left."""

    def __init__(self) -> None:
        self.count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.count += 1
        self._idle.clear()

    def leave(self) -> None:
        self.count -= 1
        if self.count == 0:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is in flight; False if the timeout came first."""
        return await set_within(self._idle, timeout_s)


SETTINGS_KEY = web.AppKey("settings", GatewaySettings)
MESH_VIEW_KEY = web.AppKey("mesh_view", MeshView)
DISPATCHER_KEY = web.AppKey("dispatcher", Dispatcher)
METRICS_KEY = web.AppKey("metrics", Metrics)
INFLIGHT_KEY = web.AppKey("inflight", Inflight)
TIMESERIES_KEY = web.AppKey("timeseries", TimeSeries)

# Set by inference handlers once they know what a request targets; read by the metrics
# middleware when the response is done.
INFER_LABELS_KEY = web.RequestKey("infer_labels", tuple[str, str])
UNKNOWN_LABELS: Labels = (UNKNOWN, UNKNOWN)


def refuse_while_draining(app: web.Application) -> None:
    """New inference requests get 503 once the drain has begun."""
    if app[MESH_VIEW_KEY].draining:
        raise UnavailableError("gateway is draining (shutting down)")

"""``python -m shardserve_gateway``: serve HTTP until SIGTERM/SIGINT, then drain and stop.

Start: HTTP is served at once, the broker connection waits for a broker in the background
(readiness 503 "broker not connected yet" meanwhile; see ``app.BrokerStartup``).

Shutdown: readiness turns 503 and new inference requests get 503 at once; requests in
flight get up to ``--drain-seconds`` to finish; then the site stops and the owned
resources close in reverse order (reply consumer, status consumer, broker).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import AsyncIterator

from aiohttp import web

from shardserve.errors import ShardserveError
from shardserve.process.lifecycle import run_service, setup_logging
from shardserve_gateway.app import BROKER_STARTUP_KEY, create_app
from shardserve_gateway.grpcapi.server import start_grpc
from shardserve_gateway.settings import GatewaySettings, build_parser
from shardserve_gateway.state import INFLIGHT_KEY, MESH_VIEW_KEY
from shardserve_gateway.tls import server_tls

_logger = logging.getLogger("shardserve_gateway")


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, run the gateway, return the exit code."""
    args = build_parser().parse_args(argv)
    try:
        settings = GatewaySettings.from_args(args)
    except (ValueError, OSError) as exc:
        print(f"shardserve_gateway: error: {exc}", file=sys.stderr)
        return 2
    setup_logging("gateway", settings.log_level)
    try:
        return run_service(lambda stop: serve(settings, stop))
    except (ShardserveError, OSError, ConnectionError) as exc:
        _logger.error("gateway failed: %s", exc)
        return 1


async def serve(settings: GatewaySettings, stop: asyncio.Event) -> None:
    """Run the HTTP server until ``stop`` is set, then drain and tear down."""
    app = create_app(settings)
    # auto_decompress off: bodies are inflated off the event loop, bounded (see body.py).
    runner = web.AppRunner(
        app, shutdown_timeout=settings.drain_seconds, access_log=None, auto_decompress=False
    )
    await runner.setup()
    try:
        if settings.reuse_port:
            await _await_mesh_status(app, settings)
        site = web.TCPSite(
            runner,
            settings.host,
            settings.http_port,
            ssl_context=server_tls(settings),
            reuse_port=settings.reuse_port or None,
        )
        await site.start()
        _logger.info(
            "gateway %s listening on %s:%d", settings.gateway_id, settings.host, settings.http_port
        )
        async with _grpc_served(app, settings):
            failure = await _until_stopped(app, stop)
            await drain(app, settings.drain_seconds)
    finally:
        await runner.cleanup()
    if failure is not None:
        raise failure
    _logger.info("gateway stopped")


@contextlib.asynccontextmanager
async def _grpc_served(app: web.Application, settings: GatewaySettings) -> AsyncIterator[None]:
    """Serve gRPC on ``--grpc-port`` (unless 0) while the body runs; after the drain, calls
    still open are cancelled."""
    if not settings.grpc_port:
        yield
        return
    server = await start_grpc(app)
    _logger.info("gateway gRPC listening on %s:%d", settings.host, settings.grpc_port)
    try:
        yield
    finally:
        await server.stop()


async def _until_stopped(app: web.Application, stop: asyncio.Event) -> BaseException | None:
    """Wait for SIGTERM/SIGINT. A broker start-up that failed (it gave up waiting for the
    broker) ends the wait too: returned, to be raised once the gateway is torn down."""
    startup = app.get(BROKER_STARTUP_KEY)
    if startup is None:
        await stop.wait()
        return None
    stopping = asyncio.ensure_future(stop.wait())
    failing = asyncio.ensure_future(startup.failure())
    await asyncio.wait((stopping, failing), return_when=asyncio.FIRST_COMPLETED)
    for waiting in (stopping, failing):
        waiting.cancel()
    return failing.result() if failing.done() and not failing.cancelled() else None


async def _await_mesh_status(app: web.Application, settings: GatewaySettings) -> None:
    """With siblings on the same port, listen only once the mesh status is known (bounded):
    a gateway that answers 503 "status not known" for its first second would fail requests
    a sibling could serve."""
    if not await app[MESH_VIEW_KEY].wait_first_status(settings.status_stale_s):
        _logger.warning(
            "no mesh status within %.1f s; listening anyway (answers 503 until one arrives)",
            settings.status_stale_s,
        )


async def drain(app: web.Application, seconds: float) -> None:
    """Stop taking inference work and wait (bounded) for in-flight HTTP requests."""
    app[MESH_VIEW_KEY].draining = True
    inflight = app[INFLIGHT_KEY]
    _logger.info("draining: %d request(s) in flight, waiting up to %.1f s", inflight.count, seconds)
    if not await inflight.wait_idle(seconds):
        _logger.warning("drain timed out with %d request(s) still in flight", inflight.count)


if __name__ == "__main__":
    sys.exit(main())

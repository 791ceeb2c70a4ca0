"""Server-sent events for streamed generations, and noticing that the client left.

The response is prepared (status 200 and headers sent) only when the first event is
ready: an error before it still gets its own HTTP status. ``cancel_on_disconnect``
cancels the handler when the client's connection closes (aiohttp would only notice at
the next write, and a generation waiting in the queue writes nothing): the cancellation
runs the handler's cleanup, which cancels the generation on the mesh.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from shardserve.process.lifecycle import request_id_var
from shardserve_gateway.responses import dump_json

EVENT_STREAM = "text/event-stream"
DISCONNECT_POLL_S = 0.1
DONE = b"data: [DONE]\n\n"


async def open_event_stream(request: web.Request) -> web.StreamResponse:
    """Send the 200 and the SSE headers (the request id too: the middleware sets it only
    on responses not yet sent)."""
    response = web.StreamResponse(
        headers={
            "Content-Type": EVENT_STREAM,
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",  # proxies must pass each event at once
            "X-Request-Id": request_id_var.get(),
        }
    )
    await response.prepare(request)
    return response


def event(payload: Any) -> bytes:
    """One ``data:`` event with a compact JSON payload."""
    return b"data: " + dump_json(payload) + b"\n\n"


def client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


@contextlib.asynccontextmanager
async def cancel_on_disconnect(request: web.Request) -> AsyncIterator[None]:
    """Cancel the current task when the client's connection closes."""
    handler = asyncio.current_task()
    assert handler is not None

    async def watch() -> None:
        # Polled: aiohttp offers no awaitable for "connection lost" to a handler.
        while True:
            await asyncio.sleep(DISCONNECT_POLL_S)
            if client_gone(request):
                handler.cancel()
                return

    watcher = asyncio.create_task(watch(), name="disconnect-watch")
    try:
        yield
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher

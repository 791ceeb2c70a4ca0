"""Process lifecycle shared by the services: logging set-up and SIGTERM/SIGINT -> drain.

A service's ``__main__`` reads its settings once, calls ``setup_logging`` and runs its
``main`` coroutine under ``run_service``; the coroutine awaits ``stop.wait()``, then
stops taking work, drains in-flight work (bounded by its grace period) and tears down
what it opened, in reverse order.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import signal
import sys
from collections.abc import Awaitable, Callable

from shardserve.process.eventloop import configured_loop_factory
from shardserve.process.heap import keep_freed_memory
from shardserve.process.settings import ProcessSettings

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get()
        return True


def setup_logging(service: str, level: str | None = None) -> None:
    """Log lines name the service, pid and request id, so one request can be followed."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_RequestIdFilter())
    handler.setFormatter(
        logging.Formatter(
            f"%(asctime)s %(levelname)s {service}[%(process)d] %(name)s "
            "req=%(request_id)s: %(message)s"
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel((level or ProcessSettings.from_env().log_level).upper())
    logging.getLogger("aio_pika").setLevel(logging.WARNING)
    logging.getLogger("aiormq").setLevel(logging.WARNING)


def run_service(main: Callable[[asyncio.Event], Awaitable[None]]) -> int:
    """Run ``main(stop)`` on a fresh loop (uvloop unless SHARDSERVE_EVENT_LOOP=asyncio);
    SIGTERM/SIGINT set ``stop``. Returns an exit code. The C heap is tuned for serving
    first (``shardserve.process.heap.keep_freed_memory``)."""
    keep_freed_memory()

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    factory = configured_loop_factory()
    try:
        with asyncio.Runner(loop_factory=factory) as loop_runner:
            loop_runner.run(runner())
    except KeyboardInterrupt:
        return 130
    return 0

"""An event loop on its own thread, so the synchronous Lite API can own broker I/O.

The broker connection must keep answering heartbeats and taking peers' parts between
``predict`` calls, so its loop runs all the time on a thread the model owns; calls hop
onto it with ``run`` and block until done. ``close`` stops the loop and joins the thread.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """One event loop running on one daemon thread until ``close``."""

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait for its result (its exception is re-raised)."""
        if not self._thread.is_alive():
            coro.close()
            raise RuntimeError("the model's event loop is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def close(self) -> None:
        """Cancel what is left on the loop (and wait for it), then stop and join."""
        if not self._thread.is_alive():
            return
        self.run(_cancel_remaining())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


async def _cancel_remaining() -> None:
    current = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not current]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)

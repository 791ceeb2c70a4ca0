"""Which event loop the services run on: uvloop when installed, else asyncio's own.

Each request crosses several processes, and in each of them most of the CPU outside the
model goes to the event loop's socket reads and writes and callback dispatch; uvloop (a
libuv-based drop-in loop) does that work in C. ``SHARDSERVE_EVENT_LOOP=asyncio`` turns
it off (e.g. to compare, or to debug with asyncio's debug mode).
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Callable

from shardserve.process.settings import EVENT_LOOP_ENV, ProcessSettings

LOOP_ENV = EVENT_LOOP_ENV
LOOPS = ("uvloop", "asyncio")


def loop_factory(choice: str | None) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The factory for ``asyncio.Runner`` (None = asyncio's default loop).

    ``choice`` is the value of SHARDSERVE_EVENT_LOOP: empty or "uvloop" -> uvloop if it is
    installed; "asyncio" -> the default loop; anything else is a ValueError."""
    value = (choice or "uvloop").strip().lower()
    if value not in LOOPS:
        raise ValueError(f"{LOOP_ENV} must be one of {', '.join(LOOPS)}, got {choice!r}")
    if value == "asyncio" or importlib.util.find_spec("uvloop") is None:
        return None
    import uvloop

    return uvloop.new_event_loop


def configured_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """``loop_factory`` for this process's SHARDSERVE_EVENT_LOOP."""
    return loop_factory(ProcessSettings.from_env().event_loop)

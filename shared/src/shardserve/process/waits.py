"""Bounded waits that never lose a cancellation: the one place services wait with a limit.

Python 3.11's ``asyncio.wait_for`` returns the awaited result when its task is cancelled
in the same loop iteration as that result arrives (CPython gh-86296, fixed in 3.12 by
rebuilding it on ``asyncio.timeout``): the cancel is dropped. A service loop such as
``while True: wait_for(event.wait(), t)`` then never ends, and the TaskGroup that owns it
hangs the shutdown. Seen in CI: a scheduler ignored SIGTERM because the agents leaving at
the same moment set its status event just as the status task was cancelled.
``asyncio.timeout`` keeps every cancellation, so these helpers are built on it, and
``asyncio.wait_for`` is banned in the services (ruff, ``pyproject.toml``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def within(awaitable: Awaitable[T], timeout_s: float) -> T:
    """``await awaitable``, or TimeoutError after ``timeout_s`` (a negative limit is 0)."""
    async with asyncio.timeout(max(timeout_s, 0.0)):
        return await awaitable


async def set_within(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait until ``event`` is set; False if ``timeout_s`` passed first."""
    try:
        await within(event.wait(), timeout_s)
    except TimeoutError:
        return False
    return True

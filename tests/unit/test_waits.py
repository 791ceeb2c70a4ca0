"""Bounded waits keep every cancellation (shardserve.process.waits).

The race: a service loop waits on an event with a limit; the event is set and the task
cancelled in the same loop iteration (an agent leaving sets the scheduler's status event
as SIGTERM cancels the status task). Python 3.11's ``asyncio.wait_for`` then returns
normally, the loop goes round again, and the shutdown hangs."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Awaitable, Callable

import pytest

from shardserve.process.waits import wait_event, within

Wait = Callable[[asyncio.Event, float], Awaitable[object]]


async def _wait_for(event: asyncio.Event, timeout_s: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), timeout_s)


async def _loop_ends_when_cancelled(wait: Wait, spins: int) -> bool:
    """A ``while True`` loop over ``wait``; set its event, let ``spins`` iterations
    pass, cancel it: whether it ended (False: it swallowed the cancel and kept looping)."""
    event = asyncio.Event()

    async def loop() -> None:
        while True:
            await wait(event, 10.0)
            event.clear()

    task = asyncio.create_task(loop())
    for _ in range(3):
        await asyncio.sleep(0)  # the loop is waiting now
    event.set()
    for _ in range(spins):
        await asyncio.sleep(0)
    task.cancel()
    try:
        async with asyncio.timeout(0.5):
            await asyncio.shield(task)
    except asyncio.CancelledError:
        return True
    except TimeoutError:
        task.cancel()  # a second cancel finds it waiting again: clean up
        await asyncio.gather(task, return_exceptions=True)
        return False
    return True


@pytest.mark.parametrize("spins", range(5))
async def test_a_wait_event_loop_ends_when_cancelled_as_its_event_is_set(spins: int) -> None:
    assert await _loop_ends_when_cancelled(wait_event, spins)


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="wait_for keeps the cancel from 3.12")
async def test_the_trap_is_real_wait_for_loses_that_cancel_on_311() -> None:
    """Why ``asyncio.wait_for`` is banned in the services (ruff TID251)."""
    assert not await _loop_ends_when_cancelled(_wait_for, 0)


async def test_wait_event_answers_whether_the_event_came() -> None:
    event = asyncio.Event()
    assert await wait_event(event, 0.01) is False
    assert await wait_event(event, -1.0) is False  # a spent limit is no limit error
    event.set()
    assert await wait_event(event, 0.0) is True
    later = asyncio.Event()
    asyncio.get_running_loop().call_later(0.01, later.set)
    assert await wait_event(later, 5.0) is True


async def test_within_returns_the_result_or_raises_timeout() -> None:
    queue: asyncio.Queue[int] = asyncio.Queue()
    with pytest.raises(TimeoutError):
        await within(queue.get(), 0.01)
    queue.put_nowait(7)
    assert await within(queue.get(), 1.0) == 7
    assert queue.empty()


async def test_within_keeps_a_cancel_that_meets_an_arriving_item() -> None:
    queue: asyncio.Queue[int] = asyncio.Queue()
    taken: list[int] = []

    async def loop() -> None:
        while True:
            taken.append(await within(queue.get(), 10.0))

    task = asyncio.create_task(loop())
    await asyncio.sleep(0)
    queue.put_nowait(1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert taken == []

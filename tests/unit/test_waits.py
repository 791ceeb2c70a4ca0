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

from shardserve.process.waits import set_within, within

Wait = Callable[[asyncio.Event, float], Awaitable[object]]


async def _wait_for(event: asyncio.Event, timeout_s: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), timeout_s)


async def _loop_ends_when_cancelled(wait: Wait, cancel_after_wakeup: bool) -> bool:
    """A ``while True`` loop over ``wait``; set its event and cancel it, either in the
    same loop iteration or once it has woken and waits again: whether it ended (False: it
    swallowed the cancel and kept looping)."""
    event = asyncio.Event()
    waiting: asyncio.Queue[None] = asyncio.Queue()  # one item each time the loop waits

    async def loop() -> None:
        while True:
            waiting.put_nowait(None)  # the loop suspends in ``wait`` before we resume
            await wait(event, 10.0)
            event.clear()

    task = asyncio.create_task(loop())
    await waiting.get()
    event.set()
    if cancel_after_wakeup:
        await waiting.get()
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


@pytest.mark.parametrize("cancel_after_wakeup", [False, True])
async def test_a_set_within_loop_ends_when_cancelled_as_its_event_is_set(
    cancel_after_wakeup: bool,
) -> None:
    assert await _loop_ends_when_cancelled(set_within, cancel_after_wakeup)


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="wait_for keeps the cancel from 3.12")
async def test_the_trap_is_real_wait_for_loses_that_cancel_on_311() -> None:
    """Why ``asyncio.wait_for`` is banned in the services (ruff TID251)."""
    assert not await _loop_ends_when_cancelled(_wait_for, cancel_after_wakeup=False)


async def test_set_within_answers_whether_the_event_came() -> None:
    event = asyncio.Event()
    assert await set_within(event, 0.01) is False
    assert await set_within(event, -1.0) is False  # a spent limit is no limit error
    event.set()
    assert await set_within(event, 0.0) is True
    later = asyncio.Event()
    asyncio.get_running_loop().call_later(0.01, later.set)
    assert await set_within(later, 5.0) is True


async def test_within_returns_the_result_or_raises_timeout() -> None:
    queue: asyncio.Queue[int] = asyncio.Queue()
    with pytest.raises(TimeoutError):
        await within(queue.get(), 0.01)
    queue.put_nowait(7)
    assert await within(queue.get(), 1.0) == 7
    assert queue.empty()


async def test_within_keeps_a_cancel_that_meets_an_arriving_item() -> None:
    queue: asyncio.Queue[int] = asyncio.Queue()
    waiting = asyncio.Event()
    taken: list[int] = []

    async def loop() -> None:
        while True:
            waiting.set()  # the loop suspends in ``within`` before we resume
            taken.append(await within(queue.get(), 10.0))

    task = asyncio.create_task(loop())
    await waiting.wait()
    queue.put_nowait(1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert taken == []

"""ArrivalOrder: handlers that wait unequal times still act in arrival order."""

from __future__ import annotations

import asyncio

from shardserve_scheduler.arrival_order import ArrivalOrder


async def test_a_quick_handler_waits_for_a_slow_one_that_arrived_first() -> None:
    order = ArrivalOrder()
    acted: list[str] = []
    release_slow = asyncio.Event()

    async def handle(name: str, work: asyncio.Event | None) -> None:
        ticket = order.ticket()
        try:
            if work is not None:
                await work.wait()  # e.g. a prompt tokenizing in a thread
            await ticket.turn()
            acted.append(name)
        finally:
            ticket.done()

    slow = asyncio.ensure_future(handle("request", release_slow))
    quick = asyncio.ensure_future(handle("cancel", None))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert acted == []  # the cancel waits for its request
    release_slow.set()
    await asyncio.gather(slow, quick)
    assert acted == ["request", "cancel"]


async def test_a_failed_handler_lets_the_next_one_go() -> None:
    order = ArrivalOrder()
    first = order.ticket()
    second = order.ticket()
    first.done()  # (its handler raised: done in its finally)
    await asyncio.wait_for(second.turn(), 5)

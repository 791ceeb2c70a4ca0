"""Handlers that may wait (a prompt tokenized in a worker thread) but must act in the
order their messages arrived: a GenerateCancel never overtakes its GenerateRequest, and
requests are admitted first come first served, while several prompts tokenize at once."""

from __future__ import annotations

import asyncio


class Ticket:
    """One message's place: ``turn`` waits for the one before to finish; ``done`` lets
    the next one go (always call it, in a ``finally``)."""

    def __init__(self, before: asyncio.Future[None] | None, mine: asyncio.Future[None]) -> None:
        self._before = before
        self._mine = mine

    async def turn(self) -> None:
        if self._before is not None:
            await asyncio.shield(self._before)  # (a cancelled waiter leaves it to the others)

    def done(self) -> None:
        if not self._mine.done():
            self._mine.set_result(None)


class ArrivalOrder:
    def __init__(self) -> None:
        self._last: asyncio.Future[None] | None = None

    def ticket(self) -> Ticket:
        """Take a place; call on arrival, before any await."""
        mine: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        before, self._last = self._last, mine
        return Ticket(before, mine)

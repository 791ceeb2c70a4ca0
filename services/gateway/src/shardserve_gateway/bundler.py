"""Group commit of requests onto the request exchange.

Every HTTP request used to cost the broker, the scheduler and the gateway a message of
its own (publish, confirm, delivery, ack; then the same for its reply). Under load most
of a small request's CPU went there, not into the model. The bundler publishes what piles
up while its previous publishes are in flight as one ``InferRequestBundle``: one publish,
one confirm, one delivery for all of them. When idle nothing waits: a lone request leaves
at the next turn of the event loop, as a plain ``InferRequest``.

``send`` returns once the broker has confirmed the message that carried the request (or
raises what the publish raised, for every request in it). One task, ``run``, owned by the
dispatcher, does the publishing; at most ``max_publishes`` messages await their confirm
at once, and requests arriving meanwhile form the next bundle.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from shardserve.errors import InferenceError, UnavailableError
from shardserve.wire.protocol import BundledRequest, InferRequest, InferRequestBundle

_logger = logging.getLogger(__name__)

MAX_ITEMS = 256
MAX_BYTES = 4 * 1024 * 1024  # tensor bytes per bundle: big requests go (nearly) alone
MAX_PUBLISHES = 2


@dataclass
class Outgoing:
    """One request waiting for its bundle to be confirmed."""

    request: InferRequest
    correlation_id: str
    size: int  # tensor bytes
    sent: asyncio.Future[None]


# publish(message, items): publishes one InferRequest or InferRequestBundle, awaits its
# confirm, raises an InferenceError when the broker refuses it.
Publish = Callable[[InferRequest | InferRequestBundle, list[Outgoing]], Awaitable[None]]


class RequestBundler:
    """Collects requests; ``run`` publishes them in bundles."""

    def __init__(
        self,
        publish: Publish,
        *,
        max_items: int = MAX_ITEMS,
        max_bytes: int = MAX_BYTES,
        max_publishes: int = MAX_PUBLISHES,
    ) -> None:
        self._publish = publish
        self._max_items = max_items
        self._max_bytes = max_bytes
        self._slots = asyncio.Semaphore(max_publishes)
        self._waiting: list[Outgoing] = []
        self._wake = asyncio.Event()
        self._closed = False
        self.bundles = 0  # messages published (a plain request counts as one)
        self.bundled_requests = 0

    async def send(self, request: InferRequest, correlation_id: str, size: int) -> None:
        """Queue ``request``; return when the message carrying it is confirmed."""
        if self._closed:
            raise UnavailableError("gateway is shutting down")
        sent: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(Outgoing(request, correlation_id, size, sent))
        self._wake.set()
        await sent

    async def run(self) -> None:
        """Publish until cancelled; on the way out, fail whatever did not leave."""
        try:
            async with asyncio.TaskGroup() as publishes:
                while True:
                    await self._wake.wait()
                    self._wake.clear()
                    await asyncio.sleep(0)  # let the handlers that are ready add theirs
                    while self._waiting:
                        await self._slots.acquire()
                        items = self._take()
                        if not items:
                            self._slots.release()
                            break
                        publishes.create_task(self._publish_released(items))
        finally:
            self._closed = True
            _fail(self._waiting, UnavailableError("gateway is shutting down"))
            self._waiting = []

    def _take(self) -> list[Outgoing]:
        """The oldest waiting requests that fit in one bundle (at least one)."""
        # A request whose caller has gone (deadline, client closed) is not sent at all.
        self._waiting = [item for item in self._waiting if not item.sent.done()]
        count, size = 0, 0
        for item in self._waiting:
            if count and (count == self._max_items or size + item.size > self._max_bytes):
                break
            count, size = count + 1, size + item.size
        taken, self._waiting = self._waiting[:count], self._waiting[count:]
        return taken

    async def _publish_released(self, items: list[Outgoing]) -> None:
        try:
            message = _message_for(items)
            self.bundles += 1
            self.bundled_requests += len(items)
            await self._publish(message, items)
        except InferenceError as exc:
            _fail(items, exc)
        except Exception as exc:  # a bug: its requests are answered, the publisher goes on
            _logger.exception("publishing %d request(s) failed", len(items))
            _fail(items, UnavailableError(f"request not sent: {type(exc).__name__}"))
        except BaseException as exc:  # cancelled (shutdown): nobody may hang
            _fail(items, UnavailableError(f"request not sent: {type(exc).__name__}"))
            raise
        else:
            for item in items:
                if not item.sent.done():
                    item.sent.set_result(None)
        finally:
            self._slots.release()


def _message_for(items: list[Outgoing]) -> InferRequest | InferRequestBundle:
    if len(items) == 1:
        return items[0].request
    return InferRequestBundle(
        requests=tuple(
            BundledRequest(correlation_id=i.correlation_id, request=i.request) for i in items
        )
    )


def _fail(items: list[Outgoing], exc: Exception) -> None:
    for item in items:
        if not item.sent.done():
            item.sent.set_exception(exc)
            # The caller may have gone (deadline): nobody retrieves the exception then.
            with contextlib.suppress(BaseException):
                item.sent.exception()

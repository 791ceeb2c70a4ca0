"""RequestBundler: group commit of requests (a stand-in publish that the test releases)."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator

import pytest

from shardserve.errors import OverloadedError, UnavailableError
from shardserve.wire.protocol import InferRequest, InferRequestBundle
from shardserve.wire.tensors import Tensor
from shardserve_gateway.bundler import Outgoing, RequestBundler


def request(name: str) -> InferRequest:
    x = Tensor(dtype="<f4", shape=(1,), data=b"\0\0\0\0")
    return InferRequest(id=name, servable="mlp", instances=({"x": x},), deadline=time.time() + 5)


class GatedPublish:
    """Records each message; every publish waits until the test opens the gate."""

    def __init__(self) -> None:
        self.messages: list[InferRequest | InferRequestBundle] = []
        self.gate = asyncio.Event()
        self.started = asyncio.Event()
        self.fail_with: Exception | None = None

    async def __call__(
        self, message: InferRequest | InferRequestBundle, items: list[Outgoing]
    ) -> None:
        self.messages.append(message)
        self.started.set()
        await self.gate.wait()
        if self.fail_with is not None:
            raise self.fail_with


@pytest.fixture
async def publish() -> GatedPublish:
    return GatedPublish()


@pytest.fixture
async def bundler(publish: GatedPublish) -> AsyncIterator[RequestBundler]:
    bundler = RequestBundler(publish, max_items=3, max_bytes=1 << 20, max_publishes=1)
    task = asyncio.create_task(bundler.run())
    yield bundler
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def awaiting_confirm(send: asyncio.Task[None]) -> bool:
    """Whether ``send`` has queued its request and waits for its confirm (its one
    suspension point)."""
    coroutine = send.get_coro()
    assert inspect.iscoroutine(coroutine)
    return inspect.getcoroutinestate(coroutine) == inspect.CORO_SUSPENDED


async def queued(*sends: asyncio.Task[None]) -> None:
    """Until every ``send`` is queued: a step that follows meets them all queued, however
    the loop ran them."""
    async with asyncio.timeout(5):
        # a coroutine's state has no event to wait on: yield to the loop until it holds
        while not all(awaiting_confirm(send) for send in sends):  # noqa: ASYNC110
            await asyncio.sleep(0)


def ids(message: InferRequest | InferRequestBundle) -> list[str]:
    if isinstance(message, InferRequest):
        return [message.id]
    return [item.request.id for item in message.requests]


async def test_a_lone_request_leaves_plain(bundler: RequestBundler, publish: GatedPublish) -> None:
    publish.gate.set()
    await bundler.send(request("a"), "c-a", 4)
    assert len(publish.messages) == 1
    assert isinstance(publish.messages[0], InferRequest)


async def test_requests_piling_up_behind_a_publish_leave_as_bundles(
    bundler: RequestBundler, publish: GatedPublish
) -> None:
    first = asyncio.create_task(bundler.send(request("a"), "c-a", 4))
    await publish.started.wait()
    rest = [asyncio.create_task(bundler.send(request(n), f"c-{n}", 4)) for n in "bcdef"]
    await queued(*rest)
    assert [ids(m) for m in publish.messages] == [["a"]]  # the rest wait behind it
    publish.gate.set()
    await asyncio.gather(first, *rest)
    assert [ids(m) for m in publish.messages] == [["a"], ["b", "c", "d"], ["e", "f"]]
    bundle = publish.messages[1]
    assert isinstance(bundle, InferRequestBundle)
    assert [item.correlation_id for item in bundle.requests] == ["c-b", "c-c", "c-d"]
    assert (bundler.bundles, bundler.bundled_requests) == (3, 6)


async def test_byte_limit_splits_bundles(publish: GatedPublish) -> None:
    bundler = RequestBundler(publish, max_items=10, max_bytes=10, max_publishes=1)
    task = asyncio.create_task(bundler.run())
    try:
        sends = [asyncio.create_task(bundler.send(request(n), n, 6)) for n in "abc"]
        publish.gate.set()
        await asyncio.gather(*sends)
        assert [ids(m) for m in publish.messages] == [["a"], ["b"], ["c"]]
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_a_refused_publish_fails_every_request_in_it(
    bundler: RequestBundler, publish: GatedPublish
) -> None:
    publish.fail_with = OverloadedError("queue is full")
    sends = [asyncio.create_task(bundler.send(request(n), n, 4)) for n in "ab"]
    publish.gate.set()
    results = await asyncio.gather(*sends, return_exceptions=True)
    assert all(isinstance(r, OverloadedError) for r in results)


async def test_a_caller_that_left_is_not_sent(
    bundler: RequestBundler, publish: GatedPublish
) -> None:
    first = asyncio.create_task(bundler.send(request("a"), "a", 4))
    await publish.started.wait()
    gone = asyncio.create_task(bundler.send(request("gone"), "gone", 4))
    kept = asyncio.create_task(bundler.send(request("kept"), "kept", 4))
    await queued(gone, kept)
    gone.cancel()
    publish.gate.set()
    await asyncio.gather(first, kept)
    assert [ids(m) for m in publish.messages] == [["a"], ["kept"]]


async def test_stopping_fails_what_waits_and_refuses_new_requests(publish: GatedPublish) -> None:
    bundler = RequestBundler(publish, max_publishes=1)
    task = asyncio.create_task(bundler.run())
    inflight = asyncio.create_task(bundler.send(request("a"), "a", 4))
    await publish.started.wait()
    waiting = asyncio.create_task(bundler.send(request("b"), "b", 4))
    await queued(waiting)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for call in (inflight, waiting):
        with pytest.raises(UnavailableError):
            await call
    with pytest.raises(UnavailableError, match="shutting down"):
        await bundler.send(request("c"), "c", 4)


async def test_an_unexpected_publish_error_fails_its_requests_and_the_bundler_goes_on(
    bundler: RequestBundler, publish: GatedPublish
) -> None:
    """A publish raising what no one expected (once: aiormq's RuntimeError for a channel
    closed under it) answers its requests; the next requests are still published."""
    publish.fail_with = RuntimeError("channel closed")
    publish.gate.set()
    with pytest.raises(UnavailableError, match="request not sent: RuntimeError"):
        await asyncio.wait_for(bundler.send(request("a"), "c-a", 4), 5)
    publish.fail_with = None
    await asyncio.wait_for(bundler.send(request("b"), "c-b", 4), 5)
    assert [ids(m) for m in publish.messages] == [["a"], ["b"]]

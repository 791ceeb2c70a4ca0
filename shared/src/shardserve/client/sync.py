"""``Client``: the blocking, MindSpore-Serving-shaped client.

It owns a private event loop running in one daemon thread and an ``AsyncClient`` living
on that loop (so one connection pool serves every call, from any thread). ``infer``
blocks; ``infer_async`` returns an ``InferFuture`` at once: ``.result()`` blocks like
MindSpore's ``ClientGrpcAsyncResult.result()``, and it can be awaited from asyncio code.
``close()`` (or leaving ``with``) cancels calls still running, closes the connections,
stops the loop and joins the thread; a client never closed is closed the same way when it
is collected or the interpreter exits (``weakref.finalize``), so a script that just drops
it sees no "Unclosed client session". ``generate`` returns the text, or with
``stream=True`` an iterator of text deltas (each pulled from the loop thread in turn).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import weakref
from collections.abc import AsyncIterator, Coroutine, Generator, Iterable, Iterator, Sequence
from types import TracebackType
from typing import Any, Generic, Literal, TypeVar, Unpack, overload

from shardserve.client.aio import AsyncClient, Result, TlsOption
from shardserve.client.generation import GenerateOptions

T = TypeVar("T")


class InferFuture(Generic[T]):
    """The pending outcome of ``Client.infer_async``: ``.result()`` or ``await``."""

    def __init__(self, future: concurrent.futures.Future[T]) -> None:
        self._future = future

    def result(self, timeout: float | None = None) -> T:
        """Block until done; return the outputs or raise the call's InferenceError."""
        return self._future.result(timeout)

    def done(self) -> bool:
        return self._future.done()

    def cancel(self) -> bool:
        return self._future.cancel()

    def __await__(self) -> Generator[Any, None, T]:
        return asyncio.wrap_future(self._future).__await__()


class Client:
    """Call one method of one servable, MindSpore Serving style.

    >>> client = Client("localhost:8080", "matmul", "predict")
    >>> client.infer({"x": np.ones((128, 96), np.float32)})["y"][0, 0]
    -48.0

    Arguments are those of ``AsyncClient``. Thread-safe: calls from several threads
    share the connection pool and run concurrently.
    """

    def __init__(
        self,
        address: str,
        servable_name: str,
        method_name: str = "predict",
        version_number: int = 0,
        *,
        timeout: float = 30.0,
        token: str | None = None,
        tls: TlsOption = False,
        max_connections: int = 64,
    ) -> None:
        self._client = AsyncClient(
            address,
            servable_name,
            method_name,
            version_number,
            timeout=timeout,
            token=token,
            tls=tls,
            max_connections=max_connections,
        )
        self._loop = asyncio.new_event_loop()
        thread = threading.Thread(
            target=self._loop.run_forever, name=f"shardserve-client-{servable_name}", daemon=True
        )
        self._life = _Life(self._client, self._loop, thread)
        thread.start()
        self._close_once = weakref.finalize(self, self._life.close)

    @property
    def infer_url(self) -> str:
        return self._client.infer_url

    @overload
    def infer(
        self,
        instances: dict[str, Any],
        *,
        request_id: str | None = ...,
        outputs: Iterable[str] | None = ...,
    ) -> Result: ...

    @overload
    def infer(
        self,
        instances: Sequence[dict[str, Any]],
        *,
        request_id: str | None = ...,
        outputs: Iterable[str] | None = ...,
    ) -> list[Result]: ...

    def infer(
        self,
        instances: dict[str, Any] | Sequence[dict[str, Any]],
        *,
        request_id: str | None = None,
        outputs: Iterable[str] | None = None,
    ) -> Result | list[Result]:
        """A dict -> a dict of numpy arrays; a list of dicts -> a list of them (in order).
        Raises an InferenceError subclass (see ``shardserve.client.errors``)."""
        return self.infer_async(instances, request_id=request_id, outputs=outputs).result()

    @overload
    def infer_async(
        self,
        instances: dict[str, Any],
        *,
        request_id: str | None = ...,
        outputs: Iterable[str] | None = ...,
    ) -> InferFuture[Result]: ...

    @overload
    def infer_async(
        self,
        instances: Sequence[dict[str, Any]],
        *,
        request_id: str | None = ...,
        outputs: Iterable[str] | None = ...,
    ) -> InferFuture[list[Result]]: ...

    def infer_async(
        self,
        instances: dict[str, Any] | Sequence[dict[str, Any]],
        *,
        request_id: str | None = None,
        outputs: Iterable[str] | None = None,
    ) -> InferFuture[Result] | InferFuture[list[Result]]:
        """Start a call and return at once; see ``InferFuture``."""
        names = None if outputs is None else tuple(outputs)
        call = self._client.infer(instances, request_id=request_id, outputs=names)
        future: InferFuture[Any] = InferFuture(self._submit(call))
        return future

    @overload
    def generate(
        self,
        prompt: str,
        *,
        stream: Literal[False] = ...,
        **options: Unpack[GenerateOptions],
    ) -> str: ...

    @overload
    def generate(
        self, prompt: str, *, stream: Literal[True], **options: Unpack[GenerateOptions]
    ) -> Iterator[str]: ...

    def generate(
        self, prompt: str, *, stream: bool = False, **options: Unpack[GenerateOptions]
    ) -> str | Iterator[str]:
        """Generate text (see ``AsyncClient.generate``): the text, or with ``stream=True``
        an iterator of text deltas; leaving the iteration early cancels the generation."""
        if not stream:
            text: str = self._submit(self._client.generate(prompt, **options)).result()
            return text
        deltas = self._submit(self._client.generate(prompt, stream=True, **options)).result()
        return self._iterate(deltas)

    def _iterate(self, deltas: AsyncIterator[str]) -> Iterator[str]:
        try:
            while True:
                more, delta = self._submit(_next_delta(deltas)).result()
                if not more:
                    return
                yield delta
        finally:
            closing = getattr(deltas, "aclose", None)
            if closing is not None and not self._life.closed:
                self._submit(closing()).result()

    def _submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        life = self._life
        with life.lock:  # close() must not stop the loop between the check and the submit
            if life.closed:
                coro.close()
                raise RuntimeError("the client is closed")
            return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def close(self) -> None:
        """Cancel running calls, close connections, stop the loop thread (idempotent)."""
        self._close_once()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class _Life:
    """What a Client owns, held apart from it so that its finalizer (which must not refer
    to the Client) can close it: the AsyncClient, the private loop and its thread."""

    def __init__(
        self, client: AsyncClient, loop: asyncio.AbstractEventLoop, thread: threading.Thread
    ) -> None:
        self.client = client
        self.loop = loop
        self.thread = thread
        self.lock = threading.Lock()
        self.closed = False

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
        asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()

    async def _shutdown(self) -> None:
        # Every task on this private loop is a call this client started: it owns them.
        current = asyncio.current_task()
        calls = [t for t in asyncio.all_tasks() if t is not current]
        for task in calls:
            task.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        await self.client.close()


async def _next_delta(deltas: AsyncIterator[str]) -> tuple[bool, str]:
    """The next delta, or (False, "") at the end (StopAsyncIteration cannot cross threads)."""
    try:
        return True, await anext(deltas)
    except StopAsyncIteration:
        return False, ""

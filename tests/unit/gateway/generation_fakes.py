"""A scripted scheduler behind the real StreamTable, for the generation routes' tests.

The gateway's stream logic (ordering, deadline, cancel on leave) runs for real; only the
broker is replaced: ``ScriptedScheduler`` records what would be published and answers a
GenerateRequest by delivering the chunks its script returns, as the reply consumer would.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from aiohttp.test_utils import TestClient, TestServer
from gateway_fakes import FakeDispatcher, ManualClock, mesh_status, servable

from shardserve.errors import ErrorCode
from shardserve.wire.protocol import (
    ErrorInfo,
    GenerateCancel,
    GenerateChunk,
    GenerateRequest,
    ServableStatus,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from shardserve_gateway.app import create_app
from shardserve_gateway.generation.streams import StreamTable
from shardserve_gateway.mesh_view import MeshView
from shardserve_gateway.settings import GatewaySettings

Script = Callable[[GenerateRequest], Sequence[GenerateChunk]]
HELLO_DELTAS = ("Hel", "lo", ",", "", " wor", "ld")  # "" = bytes held back


def chunks_of(
    deltas: Sequence[str],
    *,
    finish_reason: str = "length",
    prompt_tokens: int = 3,
    logprobs: bool = False,
) -> list[GenerateChunk]:
    """One chunk per delta (one token each), the last with finish_reason and usage."""
    out = []
    for seq, text in enumerate(deltas):
        last = seq == len(deltas) - 1
        out.append(
            GenerateChunk(
                id="r",
                seq=seq,
                token_ids=(100 + seq,),
                text=text,
                logprobs=(token_logprob(100 + seq, text),) if logprobs else (),
                finish_reason=finish_reason if last else None,  # type: ignore[arg-type]
                usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=len(deltas))
                if last
                else None,
            )
        )
    return out


def token_logprob(token_id: int, text: str) -> TokenLogprob:
    top = (TopLogprob(token_id=token_id, text=text, logprob=-0.5),)
    return TokenLogprob(token_id=token_id, text=text, logprob=-0.5, top=top)


def error_chunk(seq: int, code: ErrorCode, message: str) -> GenerateChunk:
    return GenerateChunk(id="r", seq=seq, error=ErrorInfo(code=code, message=message))


def hello(request: GenerateRequest) -> list[GenerateChunk]:
    return chunks_of(HELLO_DELTAS)


@dataclass
class ScriptedScheduler:
    """The StreamPublisher double: answers each request with its script's chunks."""

    script: Script = hello
    delay_s: float = 0.0  # between chunks
    requests: list[GenerateRequest] = field(default_factory=list)
    cancels: list[GenerateCancel] = field(default_factory=list)
    correlation_ids: list[str] = field(default_factory=list)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    published: asyncio.Event = field(default_factory=asyncio.Event)
    table: StreamTable | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def publish_generate(self, request: GenerateRequest, correlation_id: str) -> None:
        self.requests.append(request)
        self.correlation_ids.append(correlation_id)
        self.published.set()
        task = asyncio.create_task(self._feed(request, correlation_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _feed(self, request: GenerateRequest, correlation_id: str) -> None:
        assert self.table is not None
        for chunk in self.script(request):
            await asyncio.sleep(self.delay_s)
            self.table.deliver(correlation_id, chunk)

    async def publish_cancel(self, cancel: GenerateCancel, servable: str) -> None:
        self.cancels.append(cancel)
        self.cancelled.set()


@dataclass
class GenerationDispatcher(FakeDispatcher):
    """The KServe fake plus generation through a real StreamTable."""

    scheduler: ScriptedScheduler = field(default_factory=ScriptedScheduler)
    streams: StreamTable = field(init=False)

    def __post_init__(self) -> None:
        self.streams = StreamTable(self.scheduler, "shardserve.reply.gw-test")
        self.scheduler.table = self.streams

    def generate(self, request: GenerateRequest) -> Any:
        return self.streams.open(request)


def tiny_llm(**fields: Any) -> ServableStatus:
    return servable("tiny", 1, (), generation=True, **fields)


@dataclass
class GenGateway:
    client: TestClient[Any, Any]
    dispatcher: GenerationDispatcher
    view: MeshView
    clock: ManualClock

    @property
    def scheduler(self) -> ScriptedScheduler:
        return self.dispatcher.scheduler

    def url(self, path: str) -> str:
        return str(self.client.make_url(path))


MakeGenGateway = Callable[..., Awaitable[GenGateway]]


@contextlib.asynccontextmanager
async def gen_gateways() -> AsyncIterator[MakeGenGateway]:
    """Make gateways over scripted schedulers; closes them at the end."""
    clients: list[TestClient[Any, Any]] = []

    async def make(
        *servables: ServableStatus, script: Script = hello, delay_s: float = 0.0, **overrides: Any
    ) -> GenGateway:
        settings = replace(GatewaySettings(gateway_id="gw-test"), **overrides)
        clock = ManualClock()
        view = MeshView(settings.status_stale_s, clock=clock)
        dispatcher = GenerationDispatcher(scheduler=ScriptedScheduler(script, delay_s))
        # Wired as create_app wires the AmqpDispatcher's table.
        view.add_scheduler_listener(dispatcher.streams.scheduler_seen)
        dispatcher.streams.watch_status(view.fresh)
        view.update(mesh_status(*(servables or (tiny_llm(),))))
        app = create_app(settings, dispatcher=dispatcher, mesh_view=view)
        client: TestClient[Any, Any] = TestClient(TestServer(app))
        await client.start_server()
        clients.append(client)
        return GenGateway(client, dispatcher, view, clock)

    yield make
    for client in reversed(clients):
        await client.close()


async def wait_for(event: asyncio.Event, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        await event.wait()


def sse_events(body: str) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order."""
    return [block.removeprefix("data: ") for block in body.split("\n\n") if block]

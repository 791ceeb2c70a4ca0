"""What every generation route shares: the target servable, the deadline, the request
sent, and the chunks read back (whole, or one by one for a stream).

A generation route answers only for servables the scheduler marks ``generation=True``;
the gateway never tokenizes (the scheduler does). ``collect`` joins a stream into the
whole answer; ``first_chunk`` lets a streaming handler learn the outcome of the first
chunk before it commits to a 200.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from aiohttp import web
from pydantic import ValidationError

from shardserve.errors import (
    BadInputError,
    InferenceError,
    InternalError,
    NotFoundError,
    error_for,
)
from shardserve.process.lifecycle import request_id_var
from shardserve.wire.protocol import (
    ChatMessage,
    GenerateChunk,
    GenerateRequest,
    SamplingParams,
    ServableStatus,
    TokenLogprob,
    Usage,
)
from shardserve_gateway.dispatch import choose_timeout
from shardserve_gateway.errors import INTERNAL_MESSAGE
from shardserve_gateway.generation.metrics import StreamTiming
from shardserve_gateway.mesh_view import require_ready
from shardserve_gateway.state import (
    INFER_LABELS_KEY,
    MESH_VIEW_KEY,
    METRICS_KEY,
    SETTINGS_KEY,
    refuse_while_draining,
)

TIMEOUT_HEADER = "X-Request-Timeout"
GENERATE_METHOD = "generate"  # the method label of generation requests in /metrics


def generation_servable(request: web.Request, model: str, version: int = 0) -> ServableStatus:
    """The ready generation servable version ``model`` names (404 / 503 otherwise)."""
    return ready_generation_servable(
        request.app, model, version, lambda labels: request.__setitem__(INFER_LABELS_KEY, labels)
    )


def ready_generation_servable(
    app: web.Application,
    model: str,
    version: int,
    labelled: Callable[[tuple[str, str]], None],
) -> ServableStatus:
    """What ``generation_servable`` finds, for any transport: ``labelled`` gets the
    metrics labels once the servable is known (before it may turn out not ready)."""
    refuse_while_draining(app)
    servable = app[MESH_VIEW_KEY].find_servable(model, version)
    if not servable.generation:
        raise NotFoundError(f"model {model!r} is not a text-generation model")
    labelled((servable.name, GENERATE_METHOD))
    require_ready(servable)
    return servable


def request_deadline(request: web.Request) -> float:
    """Absolute deadline of a generation: X-Request-Timeout seconds when given, else
    --max-timeout. Not --default-timeout: a generation's length is the caller's choice, and
    its pace is watched instead (the stream's TokenPace: first token, between tokens)."""
    return deadline_after(request.app, request.headers.get(TIMEOUT_HEADER))


def deadline_after(app: web.Application, timeout: str | None) -> float:
    """Absolute deadline ``timeout`` seconds from now (None: --max-timeout, see above)."""
    settings = app[SETTINGS_KEY]
    seconds = choose_timeout(
        timeout,
        None,
        default_s=settings.max_timeout_s,
        max_s=settings.max_timeout_s,
    )
    return time.time() + seconds


def generate_request(
    servable: ServableStatus,
    sampling: SamplingParams,
    deadline: float,
    *,
    prompt: str | None = None,
    prompt_ids: tuple[int, ...] | None = None,
    messages: tuple[ChatMessage, ...] | None = None,
) -> GenerateRequest:
    """The wire request; what the API bodies let through and the wire refuses is a 400,
    as is a text prompt the servable would surely refuse for its size (checked here, before
    the prompt travels to the scheduler)."""
    try:
        request = GenerateRequest(
            id=request_id_var.get(),
            servable=servable.name,
            version=servable.version,
            prompt=prompt,
            prompt_ids=prompt_ids,
            messages=messages,
            sampling=sampling,
            deadline=deadline,
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        message = first["msg"].removeprefix("Value error, ")
        raise BadInputError(f"{where}: {message}" if where else message) from None
    if prompt is not None:
        _check_prompt_bytes(servable, prompt)
    return request


def _check_prompt_bytes(servable: ServableStatus, prompt: str) -> None:
    limit = servable.prompt_bytes_limit
    if limit is None:
        return
    size = len(prompt.encode("utf-8", "surrogatepass"))
    if size > limit:
        raise BadInputError(
            f"the prompt has {size} UTF-8 bytes; servable {servable.name} takes at most "
            f"{limit} (past that it surely has more tokens than the model's context)"
        )


def raise_chunk_error(chunk: GenerateChunk) -> None:
    """Raise the error a chunk carries (as the exception its code maps to)."""
    if chunk.error is not None:
        raise error_for(chunk.error.code, chunk.error.message)


@dataclass
class Generated:
    """A whole generation, joined from its chunks."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str = ""
    usage: Usage = field(default_factory=lambda: Usage(prompt_tokens=0, completion_tokens=0))


async def collect(chunks: AsyncIterator[GenerateChunk]) -> Generated:
    """Join every chunk; raise the error the stream ends with."""
    parts: list[str] = []
    generated = Generated()
    async for chunk in chunks:
        raise_chunk_error(chunk)
        parts.append(chunk.text)
        generated.token_ids += chunk.token_ids
        generated.logprobs += chunk.logprobs
        if chunk.finish_reason is not None:
            generated.finish_reason = chunk.finish_reason
            generated.usage = chunk.usage or generated.usage
    if not generated.finish_reason:
        raise InternalError("the generation stream ended without its last chunk")
    generated.text = "".join(parts)
    return generated


async def timed(
    request: web.Request, chunks: AsyncIterator[GenerateChunk]
) -> AsyncIterator[GenerateChunk]:
    """Pass chunks through, recording token timings and counts in the gateway metrics."""
    timing = StreamTiming(request.app[METRICS_KEY].generation, request[INFER_LABELS_KEY][0])
    async for chunk in chunks:
        timing.chunk(chunk)
        yield chunk


async def first_chunk(chunks: AsyncIterator[GenerateChunk]) -> GenerateChunk:
    """The first chunk, with its error raised (so the caller can still answer a status)."""
    try:
        chunk = await anext(chunks)
    except StopAsyncIteration:
        raise InternalError("the generation stream ended before its first chunk") from None
    raise_chunk_error(chunk)
    return chunk


def stream_error(exc: BaseException) -> InferenceError:
    """What a stream that already answered 200 reports in its last event."""
    if isinstance(exc, InferenceError):
        return exc
    return InternalError(INTERNAL_MESSAGE)

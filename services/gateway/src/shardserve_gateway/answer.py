"""Answering a generation over HTTP, whole or as server-sent events, in any API's shapes.

A ``Renderer`` turns the generation into one API's JSON (OpenAI completions, OpenAI chat,
Triton generate). ``answer`` runs the request: publish, read the chunks, and either join
them into one response or stream them. A stream answers 200 only once its first chunk
has arrived (so a refusal, e.g. 400 "prompt too long" or 503 "queue full", keeps its
status); a failure after that is sent as the stream's last event, in the API's error
shape, and the stream ends without a completion marker.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any, Protocol

from aiohttp import web

from shardserve.errors import BadInputError, InferenceError
from shardserve.wire.protocol import GenerateChunk, GenerateRequest, Usage
from shardserve_gateway.codecs.body import read_body
from shardserve_gateway.generation.body_limit import generation_body_limit, too_large
from shardserve_gateway.generation.requests import (
    Generated,
    collect,
    first_chunk,
    raise_chunk_error,
    stream_error,
    timed,
)
from shardserve_gateway.generation.sse import cancel_on_disconnect, event, open_event_stream
from shardserve_gateway.responses import json_response
from shardserve_gateway.state import DISPATCHER_KEY

_logger = logging.getLogger(__name__)

Json = dict[str, Any]


class Renderer(Protocol):
    """One API's shapes for one request."""

    def whole(self, generated: Generated) -> Json:
        """The non-streamed response body."""
        ...

    def events(self, chunk: GenerateChunk, first: bool) -> list[Json]:
        """The stream events one chunk becomes (none for a chunk with nothing to show)."""
        ...

    def closing(self, usage: Usage | None) -> list[bytes]:
        """What ends a successful stream (a usage event, ``[DONE]``...)."""
        ...

    def error(self, exc: InferenceError) -> Json:
        """The event that ends a failed stream."""
        ...


async def json_body(request: web.Request, model: str | None = None) -> object:
    """The request body parsed as JSON, within the generation body limit of the servables
    named ``model`` (of every generation servable when None: see ``body_limit``)."""
    limit = generation_body_limit(request.app, model)
    raw = await read_body(request, limit, too_large=too_large)
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise BadInputError(f"request body is not valid JSON: {exc}") from None
    except RecursionError:  # e.g. 100,000 nested "[": the parser recurses per level
        raise BadInputError("request body is not valid JSON: nested too deeply") from None


async def answer(
    request: web.Request, generate: GenerateRequest, renderer: Renderer, *, stream: bool
) -> web.StreamResponse:
    """Run ``generate`` and answer it whole or streamed; leaving early cancels it."""
    dispatcher = request.app[DISPATCHER_KEY]
    async with cancel_on_disconnect(request), dispatcher.generate(generate) as chunks:
        measured = timed(request, chunks)
        if not stream:
            return json_response(renderer.whole(await collect(measured)))
        return await _stream(request, measured, renderer)


async def _stream(
    request: web.Request, chunks: AsyncIterator[GenerateChunk], renderer: Renderer
) -> web.StreamResponse:
    chunk = await first_chunk(chunks)  # raises before the 200: the error keeps its status
    response = await open_event_stream(request)
    try:
        usage = await _send_all(response, chunk, chunks, renderer)
        await _write(response, b"".join(renderer.closing(usage)))
    except Exception as exc:  # every failure ends the stream with an event
        if not isinstance(exc, InferenceError):
            _logger.exception("internal error while streaming %s", request.path)
        await _write(response, event(renderer.error(stream_error(exc))))
    return response


async def _send_all(
    response: web.StreamResponse,
    chunk: GenerateChunk,
    rest: AsyncIterator[GenerateChunk],
    renderer: Renderer,
) -> Usage | None:
    """Send the first chunk and every later one; return the last chunk's usage."""
    await _write(response, b"".join(event(e) for e in renderer.events(chunk, True)))
    last = chunk
    async for last in rest:
        raise_chunk_error(last)
        await _write(response, b"".join(event(e) for e in renderer.events(last, False)))
    return last.usage


async def _write(response: web.StreamResponse, data: bytes) -> None:
    if not data:
        return
    # A client gone mid-write is noticed by the disconnect watch, which cancels us.
    with contextlib.suppress(ConnectionResetError):
        await response.write(data)

"""OpenAI-compatible routes: ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /v1/models`` (the generation servables) and ``GET /v1/models/{model}``.

Bodies and answers follow OpenAI's shapes (``codecs/openai_requests.py`` and
``codecs/openai_responses.py``), so the ``openai`` package works unchanged. Errors are
``{"error": {"message", "type", "param", "code"}}`` with the status of the error (400,
404 unknown model, 503 with Retry-After, 504 deadline, 500). An error after a stream has
started (status 200 sent) is a last ``data: {"error": {...}}`` event with no
``data: [DONE]`` after it: the ``openai`` package raises ``APIError`` with its message,
and a client that waits for ``[DONE]`` sees the stream end without it.

The model name is the servable's name; its highest ready version serves.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from shardserve.errors import ErrorCode, InferenceError, NotFoundError
from shardserve.wire.protocol import GenerateChunk, Usage
from shardserve_gateway.answer import Json, answer, json_body
from shardserve_gateway.codecs import openai_responses as shapes
from shardserve_gateway.codecs.openai_requests import ChatBody, CompletionBody, ParamError, parse
from shardserve_gateway.errors import HttpError
from shardserve_gateway.generation.requests import Generated, generate_request, generation_servable
from shardserve_gateway.generation.requests import request_deadline as deadline_of
from shardserve_gateway.generation.sse import DONE, event
from shardserve_gateway.responses import json_response
from shardserve_gateway.state import MESH_VIEW_KEY

_logger = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
RETRY_AFTER_S = "1"
OWNER = "shardserve"


def add_routes(app: web.Application) -> None:
    """Register the OpenAI-compatible routes."""
    app.router.add_post("/v1/completions", openai_errors(completions))
    app.router.add_post("/v1/chat/completions", openai_errors(chat_completions))
    app.router.add_get("/v1/models", openai_errors(list_models))
    app.router.add_get("/v1/models/{model}", openai_errors(retrieve_model))


def openai_errors(handler: Handler) -> Handler:
    """Answer every failure in OpenAI's error shape (the middleware's is KServe's)."""

    @functools.wraps(handler)
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except InferenceError as exc:
            param = exc.param if isinstance(exc, ParamError) else None
            return error_response(exc.message, exc.status, exc.code, param)
        except HttpError as exc:
            return error_response(exc.message, exc.status, None, headers=exc.headers)

    return wrapped


def error_response(
    message: str,
    status: int,
    code: ErrorCode | None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    level = logging.WARNING if status >= 500 else logging.INFO
    _logger.log(level, "answering %d: %s", status, message)
    headers = dict(headers or {})
    if status == 503:
        headers["Retry-After"] = RETRY_AFTER_S
    return json_response(shapes.error(message, status, code, param), status, headers)


def stream_error_event(exc: InferenceError) -> Json:
    return shapes.error(exc.message, exc.status, exc.code)


async def completions(request: web.Request) -> web.StreamResponse:
    body = parse(CompletionBody, await json_body(request))
    prompt, prompt_ids = body.prompt_kind()
    sampling = body.sampling(body.max_tokens, body.logprobs)
    servable = generation_servable(request, body.model)
    generate = generate_request(
        servable, sampling, deadline_of(request), prompt=prompt, prompt_ids=prompt_ids
    )
    renderer = CompletionRenderer(
        shapes.Envelope.new("cmpl", body.model), body.logprobs is not None, body.include_usage
    )
    return await answer(request, generate, renderer, stream=bool(body.stream))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = parse(ChatBody, await json_body(request))
    sampling = body.chat_sampling()
    servable = generation_servable(request, body.model)
    messages = tuple(m.message() for m in body.messages)
    generate = generate_request(servable, sampling, deadline_of(request), messages=messages)
    renderer = ChatRenderer(
        shapes.Envelope.new("chatcmpl", body.model), bool(body.logprobs), body.include_usage
    )
    return await answer(request, generate, renderer, stream=bool(body.stream))


async def list_models(request: web.Request) -> web.Response:
    data = [_model(name) for name in _model_names(request)]
    return json_response({"object": "list", "data": data})


async def retrieve_model(request: web.Request) -> web.Response:
    """One model (the openai package's ``models.retrieve``); 404 when no generation servable
    has that name."""
    name = request.match_info["model"]
    names = _model_names(request)
    if name not in names:
        known = ", ".join(names) or "none"
        raise NotFoundError(f"model {name!r} not found; models: {known}")
    return json_response(_model(name))


def _model_names(request: web.Request) -> list[str]:
    status = request.app[MESH_VIEW_KEY].require_fresh()
    return list(dict.fromkeys(s.name for s in status.servables if s.generation))


def _model(name: str) -> Json:
    return {"id": name, "object": "model", "created": 0, "owned_by": OWNER}


@dataclass
class CompletionRenderer:
    """``/v1/completions``: ``text_completion`` objects, whole and streamed."""

    envelope: shapes.Envelope
    logprobs: bool
    include_usage: bool
    text_offset: int = 0

    def whole(self, generated: Generated) -> Json:
        logprobs = shapes.completion_logprobs(generated.logprobs, 0) if self.logprobs else None
        choice = shapes.completion_choice(generated.text, generated.finish_reason, logprobs)
        body = self.envelope.body(shapes.COMPLETION, [choice])
        body["usage"] = shapes.usage(generated.usage)
        return body

    def events(self, chunk: GenerateChunk, first: bool) -> list[Json]:
        if not (chunk.text or chunk.logprobs or chunk.last):
            return []
        logprobs = None
        if self.logprobs:
            logprobs = shapes.completion_logprobs(chunk.logprobs, self.text_offset)
        self.text_offset += len(chunk.text)
        choice = shapes.completion_choice(chunk.text, chunk.finish_reason, logprobs)
        return [self._with_usage(self.envelope.body(shapes.COMPLETION, [choice]))]

    def _with_usage(self, body: Json) -> Json:
        if self.include_usage:
            body["usage"] = None  # OpenAI: null on every chunk but the usage chunk
        return body

    def closing(self, usage: Usage | None) -> list[bytes]:
        return _closing(self.envelope, shapes.COMPLETION, usage if self.include_usage else None)

    def error(self, exc: InferenceError) -> Json:
        return stream_error_event(exc)


@dataclass
class ChatRenderer:
    """``/v1/chat/completions``: ``chat.completion`` and ``chat.completion.chunk``."""

    envelope: shapes.Envelope
    logprobs: bool
    include_usage: bool

    def whole(self, generated: Generated) -> Json:
        logprobs = shapes.chat_logprobs(generated.logprobs) if self.logprobs else None
        message = {"role": "assistant", "content": generated.text}
        choice = shapes.chat_choice(message, generated.finish_reason, logprobs)
        body = self.envelope.body(shapes.CHAT, [choice])
        body["usage"] = shapes.usage(generated.usage)
        return body

    def events(self, chunk: GenerateChunk, first: bool) -> list[Json]:
        events = [self._chunk({"role": "assistant", "content": ""}, None, None)] if first else []
        if chunk.text or chunk.logprobs or chunk.last:
            logprobs = shapes.chat_logprobs(chunk.logprobs) if self.logprobs else None
            delta = {"content": chunk.text} if chunk.text else {}
            events.append(self._chunk(delta, chunk.finish_reason, logprobs))
        return events

    def _chunk(self, delta: Json, finish_reason: str | None, logprobs: Json | None) -> Json:
        choice = shapes.chat_delta(delta, finish_reason, logprobs)
        body = self.envelope.body(shapes.CHAT_CHUNK, [choice])
        if self.include_usage:
            body["usage"] = None
        return body

    def closing(self, usage: Usage | None) -> list[bytes]:
        return _closing(self.envelope, shapes.CHAT_CHUNK, usage if self.include_usage else None)

    def error(self, exc: InferenceError) -> Json:
        return stream_error_event(exc)


def _closing(envelope: shapes.Envelope, obj: str, usage: Usage | None) -> list[bytes]:
    """include_usage: a chunk with empty choices and the usage; then ``[DONE]``."""
    if usage is None:
        return [DONE]
    body = envelope.body(obj, [])
    body["usage"] = shapes.usage(usage)
    return [event(body), DONE]

"""OpenAI response shapes: completions and chat completions, whole and as stream chunks,
their two logprobs shapes, usage, and errors.

Shapes as OpenAI documents them (and vLLM serves them): a completion choice has ``text``
and legacy logprobs (``tokens``, ``token_logprobs``, ``top_logprobs`` as token -> logprob
maps, ``text_offset``); a chat choice has ``message`` (or ``delta`` in a stream) and
logprobs as ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shardserve.errors import ErrorCode
from shardserve.wire.protocol import TokenLogprob, TopLogprob, Usage

Json = dict[str, Any]

COMPLETION = "text_completion"
CHAT = "chat.completion"
CHAT_CHUNK = "chat.completion.chunk"

_ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    499: "cancelled",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout",
}


@dataclass(frozen=True)
class Envelope:
    """What every response and chunk of one request repeats."""

    id: str
    created: int
    model: str

    @classmethod
    def new(cls, prefix: str, model: str) -> Envelope:
        return cls(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), model)

    def body(self, obj: str, choices: list[Json]) -> Json:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }


def usage(value: Usage) -> Json:
    return {
        "prompt_tokens": value.prompt_tokens,
        "completion_tokens": value.completion_tokens,
        "total_tokens": value.total_tokens,
    }


def completion_logprobs(tokens: Sequence[TokenLogprob], text_offset: int) -> Json:
    """Legacy completion logprobs; ``text_offset`` is where the first token's text starts."""
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token.text)
    return {
        "tokens": [t.text for t in tokens],
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": [{top.text: top.logprob for top in t.top} for t in tokens],
        "text_offset": offsets,
    }


def _chat_token(token: TokenLogprob | TopLogprob) -> Json:
    return {"token": token.text, "logprob": token.logprob, "bytes": list(token.text.encode())}


def chat_logprobs(tokens: Sequence[TokenLogprob]) -> Json:
    return {
        "content": [
            {**_chat_token(t), "top_logprobs": [_chat_token(top) for top in t.top]} for t in tokens
        ]
    }


def completion_choice(text: str, finish_reason: str | None, logprobs: Json | None) -> Json:
    return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_choice(message: Json, finish_reason: str | None, logprobs: Json | None) -> Json:
    return {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_delta(delta: Json, finish_reason: str | None, logprobs: Json | None) -> Json:
    return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error(message: str, status: int, code: ErrorCode | None, param: str | None = None) -> Json:
    """``{"error": {"message", "type", "param", "code"}}``."""
    return {
        "error": {
            "message": message,
            "type": error_type(status),
            "param": param,
            "code": code.value if code is not None else None,
        }
    }

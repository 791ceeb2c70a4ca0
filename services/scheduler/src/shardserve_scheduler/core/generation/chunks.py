"""The numbered GenerateChunks of a sequence's stream; exactly one last chunk per stream.

A chunk per step with the step's token and its text (maybe "" while text is held back); the
last chunk has ``finish_reason`` and ``usage`` (with any text still held), or an ``error``.
A request refused before it became a sequence gets one chunk: seq 0 with the error.
"""

from __future__ import annotations

from typing import Literal

from shardserve.errors import ErrorCode
from shardserve.wire.protocol import ErrorInfo, GenerateChunk, TokenLogprob, Usage
from shardserve_scheduler.core.actions import SendChunk
from shardserve_scheduler.core.generation.sequences import Origin, Sequence


def token_chunk(
    sequence: Sequence, token: int, text: str, logprob: TokenLogprob | None
) -> SendChunk:
    """An ordinary chunk: one new token and the text it released."""
    return _send(sequence.origin, _with_token(sequence, token, text, logprob))


def last_chunk(
    sequence: Sequence,
    reason: Literal["stop", "length"],
    token: int,
    text: str,
    logprob: TokenLogprob | None,
) -> SendChunk:
    """The end of a stream that finished: its last token, the rest of the text, usage."""
    sequence.closed = True
    usage = Usage(prompt_tokens=len(sequence.prompt), completion_tokens=len(sequence.generated))
    chunk = _with_token(sequence, token, text, logprob, reason, usage)
    return _send(sequence.origin, chunk)


def _with_token(
    sequence: Sequence,
    token: int,
    text: str,
    logprob: TokenLogprob | None,
    reason: Literal["stop", "length"] | None = None,
    usage: Usage | None = None,
) -> GenerateChunk:
    """The sequence's next chunk, carrying one token (and the end, when ``reason``)."""
    return GenerateChunk(
        id=sequence.request_id,
        seq=sequence.take_chunk_number(),
        token_ids=(token,),
        text=text,
        logprobs=() if logprob is None else (logprob,),
        finish_reason=reason,
        usage=usage,
    )


def error_chunk(sequence: Sequence, code: ErrorCode, message: str) -> list[SendChunk]:
    """The end of a stream that failed; nothing if its last chunk is already out."""
    if sequence.closed:
        return []
    sequence.closed = True
    chunk = GenerateChunk(
        id=sequence.request_id,
        seq=sequence.take_chunk_number(),
        error=ErrorInfo(code=code, message=message),
    )
    return [_send(sequence.origin, chunk)]


def refusal_chunk(
    origin: Origin, code: ErrorCode, message: str, retry_after_s: float = 0.0
) -> SendChunk:
    """The whole stream of a request refused before it became a sequence."""
    error = ErrorInfo(code=code, message=message, retry_after_s=retry_after_s)
    return _send(origin, GenerateChunk(id=origin.request.id, seq=0, error=error))


def _send(origin: Origin, chunk: GenerateChunk) -> SendChunk:
    return SendChunk(origin.reply_to, origin.correlation_id, chunk)
